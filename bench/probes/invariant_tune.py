"""Where a deterministic engine's time goes, and which tiles of the batch-invariant product are fast
and give the same bits (issue 21), on the GPU machine:

1. the 1b preset's five products at M = 1 .. 2048 rows: GPU microseconds per call (a CUDA graph
   over 8 copies of the weight, so it streams from memory as in a step) of cuBLAS (F.linear), the
   fused batch-1 gemv (M = 1), the deterministic `linear` as engines run it (row_ops, then the
   product with the tile chosen by rows), the input ops alone, and the product alone through each
   candidate tile; per candidate, whether its rows have the bits of SMALL's (64 rows of 300, and a
   row alone);
2. a scheduler step at batch 1 and 32 (1,000 tokens of context), default and deterministic: wall
   ms per step and the kernels by GPU time (bench/probes/step_profile.py's measures).

    python3 bench/probes/invariant_tune.py MODEL_DIR [--json FILE] [--skip-steps]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from models.kernels.gemv import fused_gemv
from models.kernels.invariant_matmul import LARGE, MEDIUM, MEDIUM_WIDE, SMALL, SMALL_ROWS, SMALL_WIDE, Tiles, \
    invariant_matmul
from models.kernels.row_ops import rms_norm_rows, silu_mul_rows
from models import read_model_args
from models.invariant import linear

import step_profile  # bench/probes/step_profile.py (this script's folder is on sys.path)

DEV = torch.device("cuda", 0)
DT = torch.bfloat16
ROWS = (1, 16, 32, 64, 128, 256, 2048)
CANDIDATES = [SMALL, SMALL_WIDE, MEDIUM, MEDIUM_WIDE, LARGE, Tiles(16, 32, 256, 4, 4), Tiles(16, 16, 256, 1, 4),
              Tiles(16, 32, 128, 4, 6), Tiles(16, 16, 512, 2, 3), Tiles(32, 32, 256, 4, 4), Tiles(128, 128, 64, 4, 4),
              Tiles(128, 256, 64, 8, 3), Tiles(128, 64, 64, 4, 4), Tiles(64, 256, 64, 8, 3)]
MORE = [Tiles(64, 64, 64, 4, 4), Tiles(64, 64, 128, 4, 3), Tiles(128, 64, 64, 8, 3), Tiles(64, 128, 64, 4, 3),
        Tiles(128, 32, 64, 4, 4), Tiles(64, 64, 64, 4, 5), Tiles(128, 128, 64, 8, 4), Tiles(64, 128, 128, 8, 3),
        Tiles(32, 64, 128, 4, 4), Tiles(32, 128, 64, 4, 4), Tiles(64, 32, 64, 4, 5), Tiles(128, 64, 128, 8, 3)]
COPIES, REPEATS = 8, 4
R = 5  # the row checked alone
out_rows: list[dict] = []


def graph_us(calls: list) -> float:  # noqa: ANN001
    """GPU microseconds per call of `calls` (closures), replayed inside one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEATS):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (REPEATS * len(calls)))
    return statistics.median(times)


def shapes(model_dir: str) -> dict[str, tuple[int, int, dict]]:
    a = read_model_args(model_dir)
    hd = a.hidden_size // a.num_attention_heads
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * hd
    return {"qkv+norm": (qkv, a.hidden_size, {"norm": True}),
            "o_proj+res": (a.hidden_size, a.hidden_size, {"residual": True}),
            "gate_up+norm": (2 * a.intermediate_size, a.hidden_size, {"norm": True}),
            "down silu*up+res": (a.hidden_size, a.intermediate_size, {"gated": True, "residual": True}),
            "lm_head+norm": (a.vocab_size, a.hidden_size, {"norm": True})}


def products(name: str, n: int, k: int, flags: dict) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    ws = [torch.randn(n, k, generator=g, device=DEV).to(DT) * 0.02 for _ in range(COPIES)]
    norm = torch.rand(k, generator=g, device=DEV).to(DT) + 0.5 if flags.get("norm") else None
    kin = 2 * k if flags.get("gated") else k
    gated = bool(flags.get("gated"))
    for m in ROWS:
        x = torch.randn(m, kin, generator=g, device=DEV).to(DT)
        res = torch.randn(m, n, generator=g, device=DEV).to(DT) if flags.get("residual") else None
        xin = silu_mul_rows(x) if gated else x  # the product's own input
        base = {"shape": name, "m": m}
        out_rows.append({**base, "what": "cublas", "us": graph_us([lambda w=w: F.linear(xin, w) for w in ws])})
        if m == 1:
            out_rows.append({**base, "what": "fused_gemv", "us": graph_us(
                [lambda w=w: fused_gemv(x, w, norm_weight=norm, eps=1e-5, gated=gated, residual=res) for w in ws])})
        out_rows.append({**base, "what": "deterministic linear", "us": graph_us(
            [lambda w=w: linear(x, w, norm_weight=norm, eps=1e-5, gated=gated, residual=res) for w in ws])})
        prologue = (lambda: silu_mul_rows(x)) if gated else (lambda: rms_norm_rows(x, norm, 1e-5)) if norm is not None \
            else None
        if prologue:
            out_rows.append({**base, "what": "input op alone", "us": graph_us([prologue] * COPIES)})
        for tiles in CANDIDATES:
            try:
                us = graph_us([lambda w=w: invariant_matmul(xin, w, residual=res, tiles=tiles) for w in ws])
            except Exception as e:  # noqa: BLE001  (a configuration Triton cannot build: say so)
                out_rows.append({**base, "what": str(tuple(tiles)), "error": str(e)[:120]})
                continue
            row = {**base, "what": str(tuple(tiles)), "us": us}
            if m == ROWS[0]:
                row["same_bits_as_small"] = same_bits(ws[0], k, tiles)
            out_rows.append(row)
        print(f"  {name} M={m} done", file=sys.stderr, flush=True)


def same_bits(w: torch.Tensor, k: int, tiles: Tiles) -> bool:
    """Whether `tiles` gives SMALL's bits: 64 rows of a call of 300, and row R alone."""
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(300, k, generator=g, device=DEV).to(DT)
    small = invariant_matmul(x[:SMALL_ROWS].contiguous(), w, tiles=SMALL)
    return (torch.equal(invariant_matmul(x, w, tiles=tiles)[:SMALL_ROWS], small)
            and torch.equal(invariant_matmul(x[R:R + 1].contiguous(), w, tiles=tiles)[0], small[R]))


def step_grid(model_dir: str, batches: list[int], contexts: list[int]) -> None:
    """Wall ms per decode step, default vs deterministic, over batch x context (no arrivals), and the
    kernels of the largest and the smallest batch at the longest context."""
    from harness.bench.decode import local_engine
    for det in (False, True):
        engine = local_engine(model_dir, "cuda", max_num_seqs=max(batches), max_len=max(contexts) + 256,
                              kv_cache_bytes=24 << 30, deterministic=det)
        prefill(engine, det)
        for ctx in contexts:
            for b in batches:
                step_profile.run_steps(engine, b, ctx, 10, 0)
                wall = step_profile.run_steps(engine, b, ctx, 40, 0)
                out_rows.append({"shape": "grid", "m": b, "ctx": ctx, "what": "deterministic" if det else "default",
                                 "us": wall * 1e6})
                print(f"grid det={det} batch {b} context {ctx}: {wall * 1e3:.3f} ms", flush=True)
        for b in (max(batches), min(batches)):
            print(f"== kernels, deterministic={det}, batch {b}, {max(contexts)} tokens of context")
            step_profile.kernels(engine, b, max(contexts), arrivals_every=0)
        del engine
        torch.cuda.empty_cache()
    print("== grid: ms per step, default / deterministic (ratio default/det)")
    for ctx in contexts:
        for b in batches:
            d, t = ([r["us"] / 1e3 for r in out_rows if r["shape"] == "grid" and r["m"] == b and r["ctx"] == ctx
                     and r["what"] == w][0] for w in ("default", "deterministic"))
            print(f"context {ctx:5} batch {b:4}  {d:7.3f} / {t:7.3f}  ({d / t:.3f})")


def steps(model_dir: str) -> None:
    from harness.bench.decode import local_engine
    for det in (False, True):
        engine = local_engine(model_dir, "cuda", max_num_seqs=64, max_len=2048, kv_cache_bytes=8 << 30,
                              deterministic=det)
        prefill(engine, det)
        for b in (1, 32):
            step_profile.run_steps(engine, b, 1000, 20, 0)
            wall = step_profile.run_steps(engine, b, 1000, 100, 0)
            out_rows.append({"shape": "step", "m": b, "what": "deterministic" if det else "default", "us": wall * 1e6})
            print(f"== kernels, deterministic={det}, batch {b}, 1000 tokens of context: step wall {wall * 1e3:.3f} ms")
            step_profile.kernels(engine, b, 1000, arrivals_every=0)
        del engine
        torch.cuda.empty_cache()


def prefill(engine, det: bool) -> None:  # noqa: ANN001
    """Prompt tokens per second of 32 prompts of 1,000 distinct tokens, the step budget's chunks (twice: warm-up)."""
    for rnd in range(2):
        seqs = [step_profile.seq(engine, [10 + (rnd * 7919 + i * 1000 + j) % 30000 for j in range(1000)], 1)
                for i in range(32)]
        for q in seqs:
            engine.scheduler.add(q)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_work:
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    out_rows.append({"shape": "prefill", "m": 32000, "what": "deterministic" if det else "default",
                     "us": wall * 1e6, "tok_s": 32000 / wall})
    print(f"== prefill, deterministic={det}: 32 x 1000 prompt tokens in {wall * 1e3:.1f} ms ({32000 / wall:,.0f} tok/s)")


def main() -> None:
    global ROWS
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--json")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--grid", help="batches/contexts, e.g. 1,8,32,128,256/300,1000,2000: a decode step grid instead")
    ap.add_argument("--rows", help="the products' rows (default %s), with more candidate tiles" % ",".join(map(str, ROWS)))
    ns = ap.parse_args()
    torch.cuda.set_device(DEV)
    if ns.grid:
        b, c = ns.grid.split("/")
        step_grid(ns.model_dir, [int(x) for x in b.split(",")], [int(x) for x in c.split(",")])
    elif not ns.skip_steps:
        steps(ns.model_dir)
    if ns.rows:
        ROWS = tuple(int(x) for x in ns.rows.split(","))
        CANDIDATES.extend(MORE)
    for name, (n, k, flags) in shapes(ns.model_dir).items():
        products(name, n, k, flags)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out_rows, f, indent=1)
    print(f"{'shape':18} {'M':>5} {'what':28} {'us':>9}  same_bits_as_small")
    for r in out_rows:
        if "error" in r:
            print(f"{r['shape']:18} {r['m']:5} {r['what']:28} error: {r['error']}")
            continue
        print(f"{r['shape']:18} {r['m']:5} {r['what']:28} {r['us']:9.1f}  {r.get('same_bits_as_small', '')}")
    summary()


def summary() -> None:
    """Per product and M: cuBLAS, the gemv, the deterministic linear, the fastest candidate with SMALL's bits."""
    ok = {(r["shape"], r["what"]) for r in out_rows if r.get("same_bits_as_small")}
    print("== summary: us per call; best = the fastest candidate tile with SMALL's bits (the product alone)")
    for r in out_rows:
        if r["shape"] == "grid":
            continue
        if r["shape"] in ("step", "prefill"):
            print(f"{r['shape']:8} {r['m']:6} {r['what']:14} {r['us'] / 1e3:9.3f} ms" +
                  (f"  {r['tok_s']:,.0f} prompt tok/s" if "tok_s" in r else ""))
    for shape in dict.fromkeys(r["shape"] for r in out_rows if r["shape"] not in ("step", "prefill", "grid")):
        for m in ROWS:
            rs = [r for r in out_rows if r["shape"] == shape and r["m"] == m and "us" in r]
            by = {r["what"]: r["us"] for r in rs}
            cand = [r for r in rs if (shape, r["what"]) in ok]
            best = min(cand, key=lambda r: r["us"]) if cand else {"us": float("nan"), "what": "none"}
            nan = float("nan")
            print(f"{shape:18} {m:5} cublas {by.get('cublas', nan):7.1f} gemv {by.get('fused_gemv', nan):7.1f} "
                  f"det linear {by.get('deterministic linear', nan):7.1f} (input op {by.get('input op alone', nan):6.1f})"
                  f"  best {best['us']:7.1f} {best['what']}")
    bad = sorted({w for (_, w) in {(r["shape"], r["what"]) for r in out_rows if r.get("same_bits_as_small") is False}})
    print("tiles with other bits than SMALL:", ", ".join(bad) or "none")


if __name__ == "__main__":
    main()
