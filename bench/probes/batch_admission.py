"""A failover's batch of continuations on one engine process (tiny model, CPU, its own KV cache):
one `POST /v1/continuations` of N members, per run; when each member's first token came back (ms
after the batch was sent), and the engine's own line for each batch (its frames read, the last
member to the core): how long the front end took to start them all.

    python bench/probes/batch_admission.py [--members 256] [--runs 4]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from array import array
from pathlib import Path

import httpx

from models.make_model import make_model
from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from wire.batch_wire import encode_member


def batch(model: str, vocab: int, members: int, rng: random.Random) -> bytes:
    """Members of 40-120 tokens, half of them already answered (the continuation's output ids)."""
    parts = []
    for _ in range(members):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(40, 120))]
        prompt, out = ids[:len(ids) // 2], ids[len(ids) // 2:]
        body = json.dumps({"model": model, "max_tokens": len(out) + 6, "stream": True, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        parts.append(encode_member(b"/v1/completions", body, array("q", prompt), array("q", out)))
    return b"".join(parts)


def first_tokens(url: str, body: bytes) -> list[float]:
    """Seconds from the send to each member's first frame that carries token ids."""
    first: dict[int, float] = {}
    t0, buf = time.monotonic(), b""
    with httpx.stream("POST", url + "/v1/continuations", content=body, timeout=120) as r:
        for chunk in r.iter_raw():
            now, buf = time.monotonic(), buf + chunk
            while True:
                head, sep, rest = buf.partition(b"\n")
                if not sep:
                    break
                index, status, length = (int(x) for x in head.split(b" "))
                if len(rest) < length:
                    break
                payload, buf = rest[:length], rest[length:]
                if status == 200 and index not in first and any(
                        c.get("token_ids") for line in payload.decode().splitlines() if line.startswith("data: {")
                        for c in json.loads(line[6:])["choices"]):
                    first[index] = now - t0
    return sorted(first.values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--members", type=int, default=256)
    p.add_argument("--runs", type=int, default=4)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = make_model(tmp / "m", "tiny", "llama", seed=0)
    cfg = EngineConfig(name="probe", model_path=str(model), port=0, runtime_dir=str(tmp / "rt"),
                       weight_cache_mode="off", max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048)
    proc = EngineProcess(cfg, tmp / "engine.log")
    try:
        proc.wait_ready(120)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        for run in range(a.runs):
            xs = first_tokens(proc.url, batch(model.name, vocab, a.members, rng))
            print(f"run {run}: {len(xs)} of {a.members} members' first token median "
                  f"{statistics.median(xs) * 1e3:.1f} ms, max {xs[-1] * 1e3:.1f} ms after the batch was sent", flush=True)
        time.sleep(0.5)
    finally:
        proc.stop()
    for line in open(tmp / "engine.log"):
        if "continuation_batch" in line and "members answered" in line:
            print(line.strip().split("continuation_batch: ")[-1])


if __name__ == "__main__":
    main()
