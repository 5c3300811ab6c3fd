"""What a failover's continuations cost the new primary's core process on this host's CPU, part by
part, on the path they take there (no model, no GPU): the front end's `together` message (orjson, as
engines/engine_client.py sends it; an older tree's as it sent it) decoded, each member's Sequence made
(engines/core_link.py `_together`: its text state replayed), then the scheduler's steps that admit
them all into a writer's shared pool (memfd) holding their blocks (`Scheduler.schedule`: the prefix
lookup, the blocks grown, each one's scheduled marker). `--tails`: each stream's last partial block
named as the dead writer names a tail (promote_cost.fill), so each continuation recomputes one token.

    python bench/probes/core_admission.py [--streams 256] [--runs 7] [--budget 2048] [--tails] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool
from engines.block_keys import ROOT, prompt_keys
from engines.block_manager import BlockManager
from engines import core_link
from engines.core_link import decode, encode
from engines.kv_publish import Publisher
from engines.make_model import make_model
from engines.sampling import SamplingParams
from engines.scheduler import Scheduler
from engines.sequence import Sequence
from engines.tokenizer import Tokenizer

from promote_cost import FP, fill  # (bench/probes: run from the repository root)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--blocks", type=int, default=65536)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--budget", type=int, default=2048, help="the step's token budget")
    p.add_argument("--profile", action="store_true", help="cProfile the last run (own time, top 25)")
    p.add_argument("--tails", action="store_true", help="each stream's last partial block named as its tail")
    a = p.parse_args()
    rng = random.Random(0)
    tokenizer = Tokenizer(make_model(Path(tempfile.mkdtemp()), "tiny", "llama", seed=0))
    streams = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(200, 2048))] for _ in range(a.streams)]
    lay = KVLayout(num_blocks=a.blocks, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, FP, torch.device("cpu"), 0)
    index = BlockIndex(pool.fds()[1], pool.index_bytes, pool.layout)
    index.claim(lay, FP)
    fill(index, lay, streams, rng, tails=a.tails, free=a.runs * a.streams if a.tails else 0)
    params = SamplingParams(temperature=0.0, max_tokens=4096, seed=1).wire()
    raw_frame = hasattr(core_link, "raw_ids")  # (an older tree's link: ids as JSON lists, keys in hex)
    msgs, raw = [], bytearray()  # (as this tree's EngineClient.together sends them)
    for i, ids in enumerate(streams):
        keys = prompt_keys(ids, ROOT, 16)
        msg = {"op": "add", "key": i, "params": params, "group": None, "replayed": len(ids) // 2}
        if raw_frame:
            msg["raw"] = [len(raw), len(ids), len(keys) // 16]
            raw += np.asarray(ids, dtype="<i8").tobytes() + keys
        else:
            msg.update(prompt=np.asarray(ids, dtype=np.int64), keys=keys.hex())
        msgs.append(msg)
    message = encode({"op": "together", "msgs": msgs})
    parts: dict[str, list[float]] = {"decode": [], "sequences": [], "schedule": []}
    steps = []
    for run in range(a.runs):
        bm = BlockManager(lay.num_blocks, 16, scratch=lay.scratch(0), shared=lay.shared_blocks)
        bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu")))
        scheduler = Scheduler(bm, a.streams * 2, a.budget)
        profile = cProfile.Profile() if a.profile and run == a.runs - 1 else None
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        if raw_frame:
            got = [(m, *core_link.raw_ids(memoryview(raw), m["raw"])) for m in decode(message)["msgs"]]
        else:
            got = [(m, m["prompt"], bytes.fromhex(m["keys"])) for m in decode(message)["msgs"]]
        t1 = time.perf_counter()
        seqs = [Sequence(ids, SamplingParams(**m["params"]), tokenizer, set(), 8192, lambda out: None,
                         m["group"], replayed=m["replayed"], prefix_keys=keys) for m, ids, keys in got]
        for seq in seqs:
            scheduler.add(seq)
        t2 = time.perf_counter()
        n = 0
        while len(scheduler.running) < len(seqs):
            scheduler.schedule()
            n += 1
        t3 = time.perf_counter()
        if profile:
            profile.disable()
        for name, took in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[name].append(took * 1e3)
        steps.append(n)
    med = {k: statistics.median(v) for k, v in parts.items()}
    total = sum(med.values())
    print(f"{a.streams} continuations, {len(message)} + {len(raw)} bytes, runs {a.runs} (medians, ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f"; total {total:.2f} ms ({total * 1e3 / a.streams:.1f} us a continuation); steps {steps[-1]}")
    if a.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
