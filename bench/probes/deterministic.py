"""Batch invariance on CUDA, op by op and for the whole model, deterministic mode against the default:
for each case, is a row bit-identical alone and inside batches (yes/no), and the largest |diff|.

- linear: the 1b preset's five products (qkv and gate_up with RMSNorm of their input, down with
  silu(gate) * up, lm_head with the final norm), a row alone and among 3..2048 random rows;
- rms_norm: F.rms_norm (default) and the fixed-tile rms_norm;
- attention: the paged kernel, one sequence of 1500 positions: whole prefill vs chunks of 256 vs
  each position as a decode row alone and beside 32 long decode rows;
- model: the logits of one sequence's last position (200 tokens): whole prefill, prefill in chunks of
  64 then a decode step alone, and a decode step beside 1..255 other sequences' decode rows.

    python3 bench/probes/deterministic.py MODEL_DIR [--json FILE] [--device cpu]

`--device cpu` is a smoke run of the probe itself (a tiny model; the attention kernel skipped, few
batches): CPU has its own deterministic path (models/invariant.py).
"""
from __future__ import annotations

import argparse
import json
import random

import torch
import torch.nn.functional as F

from daemon.loader import load_checkpoint_into
from models.kernels.paged_attention import paged_attention, query_block
from models import build_model, read_model_args
from models.fused_decode import fused_decode_unavailable
from models.invariant import linear, rms_norm, silu_mul
from models.paged import packed_meta

DEV = torch.device("cuda")
BATCHES = (1, 7, 31, 63, 127, 255)
DT = torch.bfloat16
SIZES = [3, 17, 64, 200, 256, 2048]
rows_out: list[dict] = []


def report(case: str, mode: str, diffs: list[float]) -> None:
    row = {"case": case, "mode": mode, "identical": all(d == 0 for d in diffs), "max_diff": max(diffs)}
    rows_out.append(row)
    print(f"{case:34} {mode:13} {'yes' if row['identical'] else 'NO ':4} {row['max_diff']:.3g}", flush=True)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.0 if torch.equal(a, b) else (a.float() - b.float()).abs().max().item()


def in_batches(fn, row: torch.Tensor, g: torch.Generator) -> list[float]:  # noqa: ANN001
    """|fn(batch)[at] - fn(row alone)| for each batch size, `row` at a random place among random rows."""
    alone = fn(row[None])[0]
    out = []
    for m in SIZES:
        x = torch.randn(m, row.shape[0], generator=g, device=DEV).to(DT)
        at = int(torch.randint(0, m, (1,), generator=g, device=DEV))
        x[at] = row
        out.append(diff(fn(x)[at], alone))
    return out


def linears(model, g: torch.Generator) -> None:  # noqa: ANN001
    layer, eps = model.model.layers[0], model.args.rms_norm_eps
    attn, mlp = layer.self_attn, layer.mlp
    cases = {"qkv (+rms_norm)": (attn.qkv_proj, layer.input_layernorm.weight, False),
             "o_proj": (attn.o_proj, None, False),
             "gate_up (+rms_norm)": (mlp.gate_up_proj, layer.post_attention_layernorm.weight, False),
             "down (silu*up)": (mlp.down_proj, None, True),
             "lm_head (+final norm)": (model.lm_head, model.model.norm.weight, False)}
    for name, (lin, norm, gated) in cases.items():
        k = lin.weight.shape[1] * (2 if gated else 1)
        row = torch.randn(k, generator=g, device=DEV).to(DT)

        def default(x: torch.Tensor) -> torch.Tensor:
            if gated:
                x = silu_mul(x)
            if norm is not None:
                x = F.rms_norm(x, (x.shape[-1],), norm, eps)
            return F.linear(x, lin.weight)
        report(f"linear {name}", "default", in_batches(default, row, g))
        report(f"linear {name}", "deterministic",
               in_batches(lambda x: linear(x, lin.weight, norm_weight=norm, eps=eps, gated=gated), row, g))
    w = layer.input_layernorm.weight
    row = torch.randn(w.shape[0], generator=g, device=DEV).to(DT)
    report("rms_norm", "default", in_batches(lambda x: F.rms_norm(x, (x.shape[-1],), w, eps), row, g))
    report("rms_norm", "deterministic", in_batches(lambda x: rms_norm(x, w, eps), row, g))


def attention(g: torch.Generator) -> None:
    heads, kv_heads, d, bs, length = 32, 8, 64, 16, 1500
    max_blocks = 2048 // bs
    blocks = 34 * max_blocks + 1
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g, device=DEV).to(DT)
    perm = (torch.randperm(blocks - 1, generator=g, device=DEV) + 1).tolist()
    tables = [perm[i * max_blocks:(i + 1) * max_blocks] for i in range(34)]
    q = torch.randn(length, heads, d, generator=g, device=DEV).to(DT)
    for mode, det in (("default", False), ("deterministic", True)):
        def run(rows: torch.Tensor, work: list[tuple[list[int], int, int]]) -> torch.Tensor:
            bq = query_block(heads, kv_heads, max(n for _, _, n in work) == 1, det)
            m = packed_meta(work, bs, max_blocks, bq, DEV)
            return paged_attention(rows, cache[0], cache[1], m.cu_q, m.seq_lens, m.block_tables, m.cu_qblocks,
                                   m.num_programs, bq, merge_splits=det)
        whole = run(q, [(tables[0], 0, length)])
        chunks = torch.cat([run(q[s:s + 256], [(tables[0], s, min(256, length - s))]) for s in range(0, length, 256)])
        report("attention prefill vs chunks of 256", mode, [diff(chunks, whole)])
        positions = [0, 100, 255, 256, 700, 1024, 1499]
        report("attention decode row vs prefill", mode,
               [diff(run(q[p:p + 1], [(tables[0], p, 1)])[0], whole[p]) for p in positions])
        others = torch.randn(32, heads, d, generator=g, device=DEV).to(DT)
        work = [(tables[1 + i], 1200 + 20 * i, 1) for i in range(32)]
        got = [diff(run(torch.cat([q[p:p + 1], others]), [(tables[0], p, 1)] + work)[0], whole[p]) for p in positions]
        report("attention decode row in batch of 33", mode, got)


def model_logits(model_dir: str, g: torch.Generator) -> None:
    args = read_model_args(model_dir)
    model = build_model(args, dtype=DT, device="meta")
    model.to_empty(device=DEV)
    load_checkpoint_into(model, model_dir)
    model.init_buffers()
    bs, max_blocks = 16, 20
    model.allocate_kv_cache(257 * max_blocks + 1, bs, DEV)
    attn = model.model.layers[0].self_attn
    rng = random.Random(0)
    tables = [list(range(1 + i * max_blocks, 1 + (i + 1) * max_blocks)) for i in range(257)]
    target = [rng.randrange(args.vocab_size) for _ in range(200)]
    others = [[rng.randrange(args.vocab_size) for _ in range(rng.randrange(100, 300))] for _ in range(max(BATCHES))]

    def step(work: list[tuple[int, list[int], int, int]], det: bool) -> torch.Tensor:
        """work: (sequence index, tokens, start, n); the logits of every row."""
        bq = query_block(attn.heads, attn.kv_heads, max(w[3] for w in work) == 1, det)
        meta = packed_meta([(tables[i], s, n) for i, _, s, n in work], bs, max_blocks, bq, DEV)
        ids = torch.tensor([t for _, toks, s, n in work for t in toks[s:s + n]], device=DEV)
        pos = torch.tensor([p for _, _, s, n in work for p in range(s, s + n)], device=DEV)
        return model(ids, pos, meta)
    last = len(target) - 1
    for mode, det in (("default", False), ("deterministic", True)):
        model.deterministic = det
        model.use_fused_decode = not det and fused_decode_unavailable(model) is None
        want = step([(0, target, 0, len(target))], det)[last]
        for i in range(0, last, 64):
            step([(0, target, i, min(64, last - i))], det)
        alone = step([(0, target, last, 1)], det)[0]
        report("model: chunks of 64 + decode alone", mode, [diff(alone, want)])
        for j, o in enumerate(others):  # the others' context, in prefill chunks of up to 4 sequences
            if j % 4 == 0:
                step([(1 + k, others[k], 0, len(others[k]) - 1) for k in range(j, min(j + 4, len(others)))], det)
        got = []
        for b in BATCHES:
            work = [(0, target, last, 1)] + [(1 + k, others[k], len(others[k]) - 1, 1) for k in range(b)]
            got.append(diff(step(work, det)[0], want))
        report("model: decode in batches of 2..256", mode, got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    global DEV, SIZES, BATCHES
    DEV = torch.device(a.device)
    if DEV.type != "cuda":
        SIZES, BATCHES = [3, 17], (1, 7)
    g = torch.Generator(device=DEV).manual_seed(0)
    print(f"{'case':34} {'mode':13} {'bit-identical':4} max|diff|")
    args = read_model_args(a.model)
    shell = build_model(args, dtype=DT, device="meta")
    shell.to_empty(device=DEV)
    load_checkpoint_into(shell, a.model)
    with torch.inference_mode():
        linears(shell, g)
        del shell
        if DEV.type == "cuda":
            attention(g)
    model_logits(a.model, g)  # loads weights: outside inference mode (its forward runs in one)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
