"""What a failover's burst of continuations costs one engine's HTTP front end: N continued streams
(prompt + already generated ids, as the router sends them) arrive at once, on fresh connections.

    python3 bench/probes/continuation_burst.py MODEL_DIR [--n 256] [--prompt 600] [--done 300]
        [--device cpu|cuda] [--rounds 3] [--batch] [--warm] [--py-spy OUT]

Per round: the moment each request was written, its response head came, its first token came (ms
after the burst began; median and max over the N), and the front end's CPU seconds over the round
(per request: its cost). With --py-spy, the front end is sampled through the last round (py-spy's
raw stacks go to OUT.raw). With --batch, the N go as one `POST /v1/continuations`, as the router
sends a failover's (engines/continuation_batch.py); "head" is then each member's first frame. With
--warm every round sends the same streams: after the first, their blocks are in the engine's cache,
as a failover's are in the shared pool, so the core's share is small and the front end's shows. No supervisor: the engine alone, as the router's new primary sees it."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import tempfile
import time
from array import array
from pathlib import Path

import psutil

from engines.batch_wire import encode_member
from engines.config import EngineConfig
from harness.engine_process import EngineProcess


def body(model: str, vocab: int, prompt: int, done: int, seed: int) -> bytes:
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(prompt + done)]
    return json.dumps({"model": model, "prompt": ids[:prompt], "max_tokens": done + 16, "stream": True,
                       "return_token_ids": True, "ignore_eos": True, "seed": seed,
                       "continuation": {"prompt_token_ids": ids[:prompt], "output_token_ids": ids[prompt:]}}).encode()


async def one(port: int, payload: bytes, t0: float, out: dict[str, float]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(payload) + payload)
    out["written"] = time.monotonic() - t0
    head = await r.readuntil(b"\r\n\r\n")
    out["head"] = time.monotonic() - t0
    assert b" 200 " in head.split(b"\r\n")[0], head
    while True:
        line = await r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and b'"token_ids":[' in line and b'"token_ids":[]' not in line:
            out["token"] = time.monotonic() - t0
            break
    w.close()


def as_member(body: bytes) -> bytes:
    """A continuation's body as a member of a batch (engines/batch_wire.py): its ids framed raw."""
    req = json.loads(body)
    cont = req.pop("continuation")
    return encode_member(b"/v1/completions", json.dumps(req).encode(), array("q", cont["prompt_token_ids"]),
                         array("q", cont["output_token_ids"]))


async def batched(port: int, bodies: list[bytes], t0: float, outs: list[dict[str, float]]) -> None:
    """All of them as one batch: each member's first frame and first token, read from the frames."""
    payload = b"".join(as_member(b) for b in bodies)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/continuations HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-understudy-frames\r\n"
            b"content-length: %d\r\n\r\n" % len(payload) + payload)
    written = time.monotonic() - t0
    head = await r.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    chunked = b"chunked" in head.lower()
    buf, waiting = bytearray(), set(range(len(bodies)))
    while waiting:
        if chunked:
            size = int((await r.readline()).strip(), 16)
            data = await r.readexactly(size + 2)
            buf += data[:-2]
        else:
            buf += await r.read(65536)
        while (nl := buf.find(b"\n")) >= 0:
            index, status, length = (int(x) for x in bytes(buf[:nl]).split(b" "))
            if len(buf) < nl + 1 + length:
                break
            event, out = bytes(buf[nl + 1:nl + 1 + length]), outs[index]
            del buf[:nl + 1 + length]
            assert status in (0, 200), (index, status, event)
            out.setdefault("written", written)
            out.setdefault("head", time.monotonic() - t0)
            if b'"token_ids":[' in event and b'"token_ids":[]' not in event and "token" not in out:
                out["token"] = time.monotonic() - t0
                waiting.discard(index)
    w.close()


async def burst(port: int, bodies: list[bytes], batch: bool) -> list[dict[str, float]]:
    t0 = time.monotonic()
    outs: list[dict[str, float]] = [{} for _ in bodies]
    if batch:
        await batched(port, bodies, t0, outs)
    else:
        await asyncio.gather(*(one(port, b, t0, o) for b, o in zip(bodies, outs)))
    return outs


def frontend_of(pid: int) -> psutil.Process:
    for _ in range(100):
        for c in psutil.Process(pid).children():
            if c.name() == "engine-burst-http"[:15]:  # (its comm: prctl keeps 15 bytes)
                return c
        time.sleep(0.1)
    raise RuntimeError("no front end process")


def burst_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model and the burst's shape: N continuations of PROMPT + DONE ids (bench/probes/frontend_batch.py too)."""
    p.add_argument("model")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--done", type=int, default=300)
    return p


def main() -> int:
    p = burst_arguments(argparse.ArgumentParser())
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", action="store_true", help="all N as one POST /v1/continuations")
    p.add_argument("--budget", type=int, default=None, help="the engine's step token budget (its default if unset)")
    p.add_argument("--kv-mib", type=int, default=512, help="the engine's KV cache (--warm: room for all N)")
    p.add_argument("--warm", action="store_true", help="the same streams every round (cached after the first)")
    p.add_argument("--py-spy", dest="pyspy")
    a = p.parse_args()
    model = Path(a.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="burst-"))
    cfg = EngineConfig(name="burst", model_path=str(model), port=0, runtime_dir=str(tmp / "rt"), device=a.device,
                       weight_cache_mode="off", max_model_len=a.prompt + a.done + 64, max_num_seqs=a.n, max_num_batched_tokens=a.budget,
                       kv_cache_bytes=a.kv_mib << 20)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(300)
    front = frontend_of(proc.pid)
    port = proc.ready["port"]
    try:
        for i in range(a.rounds):
            bodies = [body(model.name, vocab, a.prompt, a.done, 1000 * (0 if a.warm else i) + j) for j in range(a.n)]
            spy = None
            if a.pyspy and i == a.rounds - 1:
                spy = subprocess.Popen(["py-spy", "record", "-p", str(front.pid), "-f", "raw", "-r", "500",
                                        "-o", a.pyspy + ".raw", "-d", "5"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            cpu0 = sum(front.cpu_times()[:2])
            outs = asyncio.run(burst(port, bodies, a.batch))
            cpu = sum(front.cpu_times()[:2]) - cpu0
            if spy is not None:
                spy.wait()
            line = [f"round {i + 1}: {a.n} continuations of {a.prompt}+{a.done} ids{' in one batch' if a.batch else ''};"]
            for k in ("written", "head", "token"):
                xs = [o[k] * 1e3 for o in outs if k in o]
                line.append(f"{k} median {statistics.median(xs):.1f} max {max(xs):.1f} ms (n={len(xs)});")
            line.append(f"front end CPU {cpu * 1e3:.0f} ms ({cpu * 1e3 / a.n:.2f} ms a request)")
            print(" ".join(line), flush=True)
            time.sleep(2.0)
    finally:
        proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
