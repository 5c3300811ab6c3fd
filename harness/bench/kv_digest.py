"""What the shared pool's KV integrity check costs (`understudy bench kv-digest`): the digest of a batch
of blocks (engines/kv/integrity.py), as computed when blocks are sealed and again when a prefix hit
or an adoption reuses them, for a model's KV layout, per block and against the bytes read."""
from __future__ import annotations

import argparse
import json
import statistics
import time

from harness.bench.arg_types import positive_int

PRESETS = {  # (layers, kv_heads, head_dim) of one rank
    "tiny": (4, 2, 16),  # the tests' model
    "llama-8b": (32, 8, 128),
}


def run(args: argparse.Namespace) -> dict:
    import torch

    from engines.kv.integrity import KVIntegrity

    layers, heads, dim = PRESETS[args.layout]
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    kv = [torch.randn(2, args.blocks + 1, args.block_size, heads, dim, device=device).to(dtype) for _ in range(layers)]
    check = KVIntegrity(kv)
    ids = list(range(1, args.blocks + 1))
    times = []
    for _ in range(args.repeat + 1):  # (the first warms up)
        began = time.perf_counter()
        check.digests(ids)
        times.append(time.perf_counter() - began)
    best, median = min(times[1:]), statistics.median(times[1:])
    block_bytes = layers * 2 * args.block_size * heads * dim * kv[0].element_size()
    return {"device": str(device), "layout": args.layout, "dtype": args.dtype, "block_size": args.block_size,
            "blocks": args.blocks, "block_bytes": block_bytes, "median_ms": median * 1e3, "best_ms": best * 1e3,
            "us_per_block": median * 1e6 / args.blocks, "gb_per_s": block_bytes * args.blocks / median / 1e9}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy bench kv-digest", description="The KV integrity check's cost: "
                                "one digest call over a batch of blocks, per block and in bytes read per second.")
    p.add_argument("--layout", choices=sorted(PRESETS), default="tiny", help="the KV layout of one rank")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the pool's dtype")
    p.add_argument("--block-size", type=positive_int, default=16, help="positions per block")
    p.add_argument("--blocks", type=positive_int, default=64, help="blocks digested in one call (a prompt's prefix)")
    p.add_argument("--repeat", type=positive_int, default=20, help="calls timed")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['blocks']} blocks of {res['block_bytes']} bytes ({res['layout']}, {res['dtype']}, {res['device']}):"
              f" {res['median_ms']:.2f} ms a call (best {res['best_ms']:.2f}), {res['us_per_block']:.1f} us a block,"
              f" {res['gb_per_s']:.2f} GB/s")
    return 0
