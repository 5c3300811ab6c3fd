"""supervisor/interrupt.py: a block stopped from outside ends quietly; every other cancel still
propagates; a late fire does nothing."""
from __future__ import annotations

import asyncio

import pytest

from wire.interrupt import Interrupt


def test_a_fired_block_ends_quietly_and_the_task_goes_on() -> None:
    async def main() -> list[str]:
        steps: list[str] = []
        interrupt = Interrupt()
        asyncio.get_running_loop().call_later(0.01, interrupt.fire)
        with interrupt:
            await asyncio.sleep(5)
            steps.append("not reached")
        steps.append("after the block")
        await asyncio.sleep(0)  # no cancel is left pending on the task
        steps.append(f"interrupted={interrupt.interrupted}, cancelling={asyncio.current_task().cancelling()}")
        return steps
    assert asyncio.run(main()) == ["after the block", "interrupted=True, cancelling=0"]


def test_a_block_that_ends_first_is_not_interrupted_by_a_later_fire() -> None:
    async def main() -> bool:
        interrupt = Interrupt()
        with interrupt:
            await asyncio.sleep(0)
        interrupt.fire()  # the block is over: nothing to cancel
        await asyncio.sleep(0.01)
        return interrupt.interrupted
    assert asyncio.run(main()) is False


def test_a_cancel_from_anyone_else_propagates() -> None:
    async def blocked(interrupt: Interrupt) -> None:
        with interrupt:
            await asyncio.sleep(5)

    async def main() -> None:
        interrupt = Interrupt()
        task = asyncio.ensure_future(blocked(interrupt))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not interrupt.interrupted
    asyncio.run(main())


def test_fire_and_another_cancel_together_still_cancel_the_task() -> None:
    async def blocked(interrupt: Interrupt) -> str:
        with interrupt:
            await asyncio.sleep(5)
        return "went on"

    async def main() -> None:
        interrupt = Interrupt()
        task = asyncio.ensure_future(blocked(interrupt))
        await asyncio.sleep(0.01)
        interrupt.fire()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_fire_while_the_awaited_result_is_already_in_is_still_delivered_inside_the_block() -> None:
    async def main() -> tuple[bool, str]:
        interrupt = Interrupt()
        fut = asyncio.get_running_loop().create_future()
        got = "nothing"

        def finish_then_fire() -> None:
            fut.set_result("result")  # the task is now due to wake with the result...
            interrupt.fire()  # ...and is cancelled before it runs
        asyncio.get_running_loop().call_soon(finish_then_fire)
        with interrupt:
            got = await fut
        await asyncio.sleep(0)
        return interrupt.interrupted, got
    assert asyncio.run(main()) == (True, "nothing")


def test_nested_interrupts_each_stop_only_their_own_block() -> None:
    async def main() -> tuple[bool, bool, str]:
        outer, inner = Interrupt(), Interrupt()
        where = ""
        with outer:
            asyncio.get_running_loop().call_later(0.01, inner.fire)
            with inner:
                await asyncio.sleep(5)
            where = "between the blocks"
            await asyncio.sleep(0.01)
        return outer.interrupted, inner.interrupted, where
    assert asyncio.run(main()) == (False, True, "between the blocks")


def test_outer_and_inner_fired_together_end_at_the_outer_block() -> None:
    async def main() -> tuple[bool, bool, str]:
        outer, inner = Interrupt(), Interrupt()
        where = "outside"
        with outer:
            def both() -> None:
                inner.fire()
                outer.fire()
            asyncio.get_running_loop().call_later(0.01, both)
            with inner:
                await asyncio.sleep(5)
            where = "between the blocks (not reached: the outer block was stopped too)"
        return outer.interrupted, inner.interrupted, where
    assert asyncio.run(main()) == (True, False, "outside")
