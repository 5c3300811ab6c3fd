"""Paged decode attention's tuning on the GPU: time the kernel (engines/kernels/paged_attention.py)
at the serving shapes of the 1b preset for each (keys per tile, warps, pipeline stages, keys per
split), against the kernel's defaults, and print the best per shape. Timed inside CUDA graphs, as
the engine runs it: timed from Python, a slow host's launch cost (~85 µs a call) hid every
difference.

    python bench/probes/attention_tune.py [--quick]
    python bench/probes/attention_tune.py --deterministic  # the deterministic engines' variants instead
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from engines.kernels.paged_attention import BLOCK_KEYS, MIN_SPLIT_KEYS, NO_SPLIT, NUM_STAGES, NUM_WARPS, \
    check_query_tiles, paged_attention

# the deterministic engines' attention (issue 21): (name, keyword arguments), decode's query tile
DETERMINISTIC_VARIANTS = [
    ("det: one program per row (fallback)", dict(min_split_keys=NO_SPLIT, merge_splits=True)),
    ("det: splits merged in order", dict(merge_splits=True)),
]

HEADS, KV_HEADS, D, BLOCK, MAX_LEN = 32, 8, 64, 16, 2048  # the 1b preset, configs/h200-1b.yaml


def shape(batch: int, lens: list[int], shared: int, seed: int = 0) -> tuple:
    """Decode rows of `batch` sequences with context `lens`, the first `shared` positions in the same
    blocks (a shared prefix). Returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = MAX_LEN // BLOCK
    shared_blocks = shared // BLOCK
    num_blocks = 1 + shared_blocks + batch * max_blocks
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, D, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, D, generator=g).to("cuda", torch.bfloat16)
    tables = torch.zeros(batch, max_blocks, dtype=torch.long)
    nxt = 1 + shared_blocks
    for b in range(batch):
        need = -(-lens[b] // BLOCK)
        own = list(range(nxt, nxt + need - shared_blocks))
        nxt += len(own)
        tables[b, :need] = torch.tensor(list(range(1, 1 + shared_blocks)) + own)
    q = torch.randn(batch, HEADS, D, generator=g).to("cuda", torch.bfloat16)
    cu = torch.arange(batch + 1, device="cuda")
    return q, k, v, cu, torch.tensor(lens, device="cuda"), tables.cuda(), cu, batch, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", help="only these: block_n,warps,stages,split;... (each printed)")
    ap.add_argument("--deterministic", action="store_true")
    ns = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    shapes = {
        "shared-prefix b32 ctx1600": shape(32, [1532 + 32 + 64] * 32, 1504),
        "chat b32 ctx 64-640": shape(32, torch.randint(64, 640, (32,), generator=g).tolist(), 0),
        "nano b256 ctx 100-2048": shape(256, torch.randint(100, 2048, (256,), generator=g).tolist(), 0),
    }
    if ns.deterministic:
        return deterministic(shapes)
    grid = list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3), (256,)))
    grid += list(itertools.product((64, 128), (4,), (2, 3), (128, 512)))
    if ns.quick:
        grid = list(itertools.product((64, 128), (4,), (2, 3), (256,)))
    if ns.configs:
        grid = [tuple(int(x) for x in c.split(",")) for c in ns.configs.split(";")]
    print(f"{'shape':28} {'default us':>10}  best us  (block_n, warps, stages, split keys)")
    for name, args in shapes.items():
        ref = paged_attention(*args)
        default = triton.testing.do_bench_cudagraph(lambda: paged_attention(*args), rep=100) * 1e3
        results = []
        for block_n, warps, stages, split in grid:
            kw = dict(block_n=block_n, num_warps=warps, num_stages=stages, min_split_keys=split)
            try:
                out = paged_attention(*args, **kw)
                if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    print(f"  {name}: {kw} differs from the default, skipped")
                    continue
                t = triton.testing.do_bench_cudagraph(lambda: paged_attention(*args, **kw), rep=50) * 1e3
            except Exception as e:  # noqa: BLE001 (a tile that does not fit: out of shared memory)
                print(f"  {name}: {kw}: {type(e).__name__}")
                continue
            results.append((t, block_n, warps, stages, split))
        if ns.configs:
            print(f"{name:28} default {default:.1f} us; " + "; ".join(f"{c}: {t:.1f}" for t, *c in results))
            continue
        results.sort()
        print(f"{name:28} {default:10.1f}  {results[0][0]:7.1f}  {results[0][1:]}  "
              f"(defaults {BLOCK_KEYS}, {NUM_WARPS}, {NUM_STAGES}, {MIN_SPLIT_KEYS}); next: "
              + "; ".join(f"{t:.1f} {c}" for t, *c in results[1:4]))


def deterministic(shapes: dict) -> None:
    """Each deterministic variant against the default kernel, per shape (µs a layer, in CUDA graphs),
    and check_query_tiles' verdict at the preset's heads."""
    ok = check_query_tiles(HEADS, KV_HEADS, D, torch.bfloat16, torch.device("cuda", 0))
    print(f"check_query_tiles({HEADS}, {KV_HEADS}, {D}, bf16): {ok}")
    for name, args in shapes.items():
        ref = paged_attention(*args)
        default = triton.testing.do_bench_cudagraph(lambda: paged_attention(*args), rep=100) * 1e3
        print(f"{name:28} default {default:7.1f} us")
        for label, kw in DETERMINISTIC_VARIANTS:
            call = lambda: paged_attention(*args, **kw)  # noqa: E731
            diff = (call().float() - ref.float()).abs().max().item()
            t = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3
            print(f"  {label:40} {t:7.1f} us  ({t / default:.2f} x default; max |diff| to it {diff:.3g})")


if __name__ == "__main__":
    main()
