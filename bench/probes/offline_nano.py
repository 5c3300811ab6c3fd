"""Offline `nano` workload through the engine in-process (no HTTP): 256 requests with input and
output lengths uniform in 100-1024, ignore_eos, all submitted at once; output tokens/s.
Usage: python bench/probes/offline_nano.py MODEL_DIR [--budget N] [--kv-gb G]"""
import argparse
import random
import time

import torch

from harness.bench.decode import local_engine
from engines.sampling import SamplingParams
from engines.sequence import Sequence

ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("--budget", type=int, default=None)
ap.add_argument("--kv-gb", type=float, default=16)
ap.add_argument("--requests", type=int, default=256)
ns = ap.parse_args()
engine = local_engine(ns.model_dir, "cuda", max_num_seqs=ns.requests, max_len=2048,
                      kv_cache_bytes=int(ns.kv_gb * 2**30), max_num_batched_tokens=ns.budget)
rng = random.Random(0)
vocab = engine.tokenizer.vocab_size
for rep in range(2):  # the first pass warms up (Triton compiles, allocator)
    seqs = []
    for _ in range(ns.requests):
        n_in, n_out = rng.randint(100, 1024), rng.randint(100, 1024)
        p = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
        seqs.append(Sequence([rng.randrange(10, vocab) for _ in range(n_in)], p, engine.tokenizer, set(),
                             engine.max_model_len, lambda o: None))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in seqs:
        engine.scheduler.add(s)
    while engine.has_work:
        engine.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = sum(len(s.output_ids) for s in seqs)
    print(f"pass {rep}: {len(seqs)} requests, {out} output tokens in {dt:.2f} s: {out / dt:.0f} output tok/s, "
          f"{engine.steps} steps, preemptions {engine.scheduler.preemptions}, budget {engine.runner.max_rows}")
