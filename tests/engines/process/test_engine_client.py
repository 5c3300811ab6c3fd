"""engines/frontend/engine_client.py over real zmq sockets: the core's side is played by the test (the
messages engines/core/core_link.py sends), the client is the front end's own."""
from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import zmq

from engines.core.core_link import encode
from engines.frontend.engine_client import EngineClient
from engines.core.sampling import SamplingParams


@pytest.fixture
def core(tmp_path: Path):  # noqa: ANN201
    """The core's side of the link, played by the test: (to_core, to_frontend, its PUSH socket)."""
    to_core, to_frontend = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    ctx = zmq.Context()
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.bind(to_core)
    core_out.bind(to_frontend)
    yield to_core, to_frontend, core_out
    ctx.destroy(linger=0)


def test_a_steps_first_outputs_are_handed_out_before_the_rest(core) -> None:  # noqa: ANN001
    """Each emit wakes one stream; a new request's first token must not queue behind the chunks of
    the streams already running."""
    to_core, to_frontend, core_out = core

    async def main() -> list[tuple[int, str]]:
        client = EngineClient(to_core, to_frontend)
        order: list[tuple[int, str]] = []
        keys = [client.submit([1, 2], SamplingParams(max_tokens=4), lambda out, i=i: order.append((i, out.delta)))
                for i in range(4)]
        running = [[k, 0, f"t{k}", None, 2, 2, [7], None, None] for k in keys[:2]]
        first = [[k, 0, f"first{k}", None, 2, 1, [7], None, [0.001, 0.004]] for k in keys[2:]]
        core_out.send(encode({"op": "out", "outs": running + first}))
        core_out.send(encode({"op": "stop"}))
        await asyncio.wait_for(client.run(), 10)
        return order
    order = asyncio.run(main())
    assert order == [(2, "first2"), (3, "first3"), (0, "t0"), (1, "t1")]


def test_messages_that_arrive_while_it_waits_are_read_and_a_failing_emit_stops_nothing(core) -> None:  # noqa: ANN001
    """The reader is a callback on zmq's descriptor: outputs sent after it started waiting reach
    their requests (each send is a new edge), several queued at once are all read, and one
    request's emit raising leaves the others and the reader running."""
    to_core, to_frontend, core_out = core

    async def main() -> list[str]:
        client = EngineClient(to_core, to_frontend)
        got: list[str] = []

        def broken(out) -> None:  # noqa: ANN001
            raise RuntimeError("a request's emit failed")
        bad = client.submit([1], SamplingParams(max_tokens=4), broken)
        good = client.submit([1], SamplingParams(max_tokens=4), lambda out: got.append(out.delta))
        reader = asyncio.ensure_future(client.run())
        for i in range(3):
            await asyncio.sleep(0.05)  # the reader is idle, waiting on the descriptor
            outs = [[k, 0, f"{k}:{i}", None, 1, 1, [7], None, None] for k in (bad, good)]
            core_out.send(encode({"op": "out", "outs": outs}))
            core_out.send(encode({"op": "stats", "stats": {"steps": i}}))
        core_out.send(encode({"op": "stop"}))
        await asyncio.wait_for(reader, 10)
        assert client.stats() == {"steps": 2}
        return got
    assert asyncio.run(main()) == ["1:0", "1:1", "1:2"]


def test_submits_and_aborts_inside_together_reach_the_core_as_one_message_in_order(tmp_path: Path) -> None:
    """`together` (a failover's batch, engines/frontend/continuation_batch.py): what is submitted and aborted
    inside goes out as one `together` message when the block ends, in order; outside, one each."""
    to_core, to_frontend = f"ipc://{tmp_path}/in2.sock", f"ipc://{tmp_path}/out2.sock"
    ctx = zmq.Context()
    core_in = ctx.socket(zmq.PULL)
    core_in.bind(to_core)
    ctx.socket(zmq.PUSH).bind(to_frontend)
    try:
        client = EngineClient(to_core, to_frontend)
        with client.together():
            a = client.submit([1, 2], SamplingParams(max_tokens=4), lambda out: None)
            b = client.submit([3], SamplingParams(max_tokens=4), lambda out: None)
            client.abort(a)
            assert not core_in.poll(100)  # (nothing sent before the block ends)
        c = client.submit([4], SamplingParams(max_tokens=4), lambda out: None)
        first, second = orjson.loads(core_in.recv()), orjson.loads(core_in.recv())
    finally:
        ctx.destroy(linger=0)
    assert first["op"] == "together"
    assert [(m["op"], m["key"]) for m in first["msgs"]] == [("add", a), ("add", b), ("abort", a)]
    assert second["op"] == "add" and second["key"] == c and second["prompt"] == [4]
