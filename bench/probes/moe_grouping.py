"""Issue 55: `group_by_expert` in two Triton launches against the ~25 torch ops it replaced, and the
routing (`route_tokens`, one launch) against torch's five (both kept here as they were at f18a6e2), at a decode step's and a prefill's row counts of moe-30b-a3b (128 experts,
top 8): the host time of a call (what a CUDA graph's capture pays, per MoE layer and graph), the GPU
time of one call replayed in a CUDA graph, and that both give the same rows. GPU only.

    python3 bench/probes/moe_grouping.py
"""
from __future__ import annotations

import time

import torch

from models.kernels.moe import block_rows, group_by_expert, route_tokens


def torch_ops(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version (f18a6e2)."""
    flat = ids.flatten()
    n = flat.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = padded.cumsum(0)
    order = flat.sort(stable=True).indices
    expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    total = -(-(n + min(experts, n) * (bm - 1)) // bm) * bm
    rows = torch.full((total,), n, dtype=torch.int32, device=ids.device)
    rows[(ends - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, total, bm, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return rows, torch.where(block_expert < experts, block_expert, -1).to(torch.int32)


def torch_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of the routing (f18a6e2)."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights, ids


def timed(fn, *args) -> tuple[float, float]:
    """(host ms of a call, GPU ms of a call replayed in a graph): medians."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    host = []
    for _ in range(50):
        t0 = time.perf_counter()
        fn(*args)
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    gpu = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    return sorted(host)[25] * 1e3, sorted(gpu)[25]


def main() -> None:
    experts, top_k = 128, 8
    print(f"{'tokens':>6} {'bm':>3}  {'torch ops: host / GPU ms':>26}  {'two launches: host / GPU ms':>28}  same")
    for tokens in (1, 16, 64, 256, 512, 2048):
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
        bm = block_rows(tokens * top_k, experts)
        same = all(torch.equal(a, b) for a, b in zip(torch_ops(ids, experts, bm), group_by_expert(ids, experts, bm)))
        old, new = timed(torch_ops, ids, experts, bm), timed(group_by_expert, ids, experts, bm)
        print(f"{tokens:>6} {bm:>3}  {old[0]:>12.3f} / {old[1]:>8.4f}  {new[0]:>14.3f} / {new[1]:>8.4f}  {same}")
    print(f"routing, 128 experts, top 8\n{'tokens':>6}  {'torch ops: host / GPU ms':>26}  {'one launch: host / GPU ms':>26}")
    for tokens in (1, 64, 256, 2048):
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        old, new = timed(torch_route, logits, top_k, True), timed(route_tokens, logits, top_k, True)
        print(f"{tokens:>6}  {old[0]:>12.3f} / {old[1]:>8.4f}  {new[0]:>12.3f} / {new[1]:>8.4f}")


if __name__ == "__main__":
    main()
