"""supervisor/effects/control.py: the supervisor's end of the control channel, over real ipc sockets,
read by the event loop's own reader (a message in the loop round that sees it)."""
from __future__ import annotations

import asyncio
import json
import os
import stat

import zmq

from supervisor.effects.control import ControlChannel, EngineMessage


async def _wait_for(pred, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


def test_messages_reach_the_callback_malformed_ones_as_none_and_replies_go_to_the_engine(tmp_path) -> None:
    async def run() -> None:
        path = str(tmp_path / "control.sock")
        ch = ControlChannel(zmq.Context.instance(), path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        got: list[EngineMessage | None] = []
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"a:1")
        dealer.connect(ch.endpoint)
        dealer.send(json.dumps({"type": "hello", "engine": "a", "incarnation": 1, "pid": 7}).encode())
        await asyncio.sleep(0.05)  # queued before anyone listens: read once the reader is added
        ch.listen(asyncio.get_running_loop(), got.append)
        await _wait_for(lambda: len(got) == 1)
        dealer.send(b"{not json")
        dealer.send(json.dumps({"type": "promoted", "engine": "a", "incarnation": 1, "adopted_blocks": 3}).encode())
        await _wait_for(lambda: len(got) == 3)
        assert got[0].type == "hello" and got[0].pid == 7
        assert got[1] is None
        assert got[2].type == "promoted" and got[2].get("adopted_blocks") == 3
        assert ch.send_now("a", 1, {"cmd": "promote"})  # to the engine connected as a:1
        assert json.loads(await asyncio.wait_for(asyncio.to_thread(dealer.recv), 5)) == {"cmd": "promote"}
        assert not ch.send_now("b", 1, {"cmd": "promote"})  # nobody is b:1: refused, logged, False
        for i in range(20):  # replies and messages crossing: none is left unread after a send
            dealer.send(json.dumps({"type": "heartbeat", "engine": "a", "incarnation": 1, "n": i}).encode())
            ch.send_now("a", 1, {"cmd": "noop"})
        await _wait_for(lambda: len(got) == 23)
        assert [m.get("n") for m in got[3:]] == list(range(20))
        dealer.close(0)
        ch.close()

    asyncio.run(run())
