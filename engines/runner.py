"""ModelRunner: runs prefill and batched decode steps on one rank; KV slots; CUDA graphs for decode.

Under tensor parallelism rank 0 broadcasts every step (a small int64 header, then the token
ids / positions / slots) on a gloo group before running it, and ranks 1..N-1 sit in
`worker_loop`, running the same step so the model's collectives line up. Only rank 0 samples.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from .models import CausalLM, Decode, Prefill
from .models.fused_decode import FUSED_MAX_BATCH, fused_decode_unavailable

log = logging.getLogger("engines.runner")

EXIT, PREFILL, DECODE = 0, 1, 2
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class KVBudgetError(ValueError):
    """kv_cache_bytes cannot hold even one sequence of max_model_len tokens."""


class ModelRunner:
    """Owns the model on one rank, its KV cache, and (on CUDA) the captured decode graphs."""

    def __init__(self, model: CausalLM, device: torch.device, rank: int = 0, tp_size: int = 1,
                 ctrl_group: dist.ProcessGroup | None = None, fused_kernels: bool = True):
        self.model, self.device, self.rank, self.tp_size = model, device, rank, tp_size
        self.ctrl_group = ctrl_group
        self.fused_kernels = fused_kernels
        self.fused_decode_status = "off (no KV cache yet)"
        self.num_slots = 0
        self.max_len = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pad_slot = -1

    # ---- setup -----------------------------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_bytes: int, max_model_len: int, max_num_seqs: int,
                          reserve_pad_slot: bool) -> int:
        """Size the slots from the byte budget (capped at max_num_seqs), allocate, return the slot count."""
        per_slot = self.model.kv_bytes_per_slot(max_model_len)
        slots = kv_cache_bytes // per_slot
        if slots < 1:
            raise KVBudgetError(
                f"kv_cache_bytes={kv_cache_bytes} cannot hold one sequence of max_model_len={max_model_len} "
                f"({per_slot} bytes per sequence on this rank); raise kv_cache_bytes or lower max_model_len")
        slots = min(slots, max_num_seqs)
        # CUDA graph padding rows write their K/V into one spare slot no sequence owns.
        self.model.allocate_kv_cache(slots + int(reserve_pad_slot), max_model_len, self.device)
        self.num_slots, self.max_len = slots, max_model_len
        self._pad_slot = slots if reserve_pad_slot else -1
        reason = fused_decode_unavailable(self.model) if self.fused_kernels else "fused_kernels is false"
        self.model.use_fused_decode = reason is None
        self.fused_decode_status = f"off ({reason})" if reason else f"on (batches up to {FUSED_MAX_BATCH})"
        return slots

    def capture_graphs(self, max_batch: int) -> list[int]:
        """Capture one decode graph per batch size up to max_batch (largest first, one memory pool)."""
        if self.device.type != "cuda":
            return []
        if self._pad_slot < 0:
            raise RuntimeError("capture_graphs needs allocate_kv_cache(..., reserve_pad_slot=True)")
        sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < max_batch} | {max_batch})
        n = max(sizes)
        self._g_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self._g_meta = torch.zeros(2, n, dtype=torch.long, device=self.device)  # positions, slots
        self._g_meta[1].fill_(self._pad_slot)
        pos, slots = self._g_meta
        pool = None
        for b in reversed(sizes):
            step = Decode(slots[:b])
            self.model(self._g_ids[:b], pos[:b], step)  # warm up kernels and NCCL outside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self._g_ids[:b], pos[:b], step)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        return sizes

    # ---- steps (rank 0) --------------------------------------------------------------------
    def prefill(self, token_ids: list[int], slot: int) -> torch.Tensor:
        """Prefill one sequence into `slot`; returns its last-token logits `[1, vocab]`."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        self._broadcast(PREFILL, len(token_ids), slot, ids)
        return self._run_prefill(ids, slot)

    def decode(self, token_ids: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """One token for each sequence; returns `[B, vocab]` logits. `token_ids` may be on the
        device (sampled by the previous step); under tensor parallelism they are fetched to
        broadcast them, so TP steps do not overlap."""
        meta = torch.tensor([positions, slots], dtype=torch.long)
        if self.tp_size > 1:
            token_ids = token_ids.cpu()
            self._broadcast(DECODE, len(positions), 0, torch.cat([token_ids.view(1, -1), meta]).view(-1))
        return self._run_decode(token_ids, meta)

    def shutdown(self) -> None:
        """Tell the workers to leave their loop (rank 0)."""
        if self.tp_size > 1:
            self._broadcast(EXIT, 0, 0, None)

    # ---- worker ranks ----------------------------------------------------------------------
    def worker_loop(self) -> None:
        """Follow rank 0's steps until it broadcasts EXIT."""
        while True:
            header = torch.zeros(3, dtype=torch.long)
            dist.broadcast(header, 0, group=self.ctrl_group)
            kind, n, slot = header.tolist()
            if kind == EXIT:
                return
            if kind == PREFILL:
                ids = torch.empty(n, dtype=torch.long)
                dist.broadcast(ids, 0, group=self.ctrl_group)
                self._run_prefill(ids, slot)
            elif kind == DECODE:
                data = torch.empty(3 * n, dtype=torch.long)
                dist.broadcast(data, 0, group=self.ctrl_group)
                data = data.view(3, n)
                self._run_decode(data[0], data[1:])
            else:
                raise RuntimeError(f"rank {self.rank}: unknown step kind {kind} from rank 0")

    # ---- shared ----------------------------------------------------------------------------
    def _broadcast(self, kind: int, n: int, slot: int, payload: torch.Tensor | None) -> None:
        if self.tp_size == 1:
            return
        dist.broadcast(torch.tensor([kind, n, slot], dtype=torch.long), 0, group=self.ctrl_group)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.ctrl_group)

    def _run_prefill(self, ids: torch.Tensor, slot: int) -> torch.Tensor:
        ids = ids.to(self.device, non_blocking=True)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.model(ids, positions, Prefill(slot=slot, start=0))

    def _run_decode(self, ids: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """`ids [B]` (host or device) and `meta [2, B]` (positions, slots; host)."""
        b = ids.shape[0]
        size = next((g for g in sorted(self.graphs) if g >= b), None)
        if size is None:
            pos, slots = meta.to(self.device, non_blocking=True)
            return self.model(ids.to(self.device, non_blocking=True), pos, Decode(slots))
        graph, out = self.graphs[size]
        if size > b:  # padding rows: position 0 of the spare slot (their stale token ids are harmless)
            pad = torch.tensor([[0], [self._pad_slot]], dtype=torch.long).expand(2, size - b)
            meta = torch.cat([meta, pad], dim=1)
        self._g_ids[:b].copy_(ids, non_blocking=True)
        self._g_meta[:, :size].copy_(meta, non_blocking=True)  # one host-to-device copy
        graph.replay()
        return out[:b]


def init_distributed(rank: int, tp_size: int, device: torch.device, port: int) -> dist.ProcessGroup | None:
    """Join the engine's process group (gloo on CPU, NCCL on CUDA); returns the gloo step group."""
    if tp_size == 1:
        return None
    # Idle workers wait on the step broadcast for as long as the engine lives: no timeout there.
    forever = timedelta(days=365)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp_size, timeout=forever, **kwargs)
    return dist.new_group(backend="gloo", timeout=forever) if backend == "nccl" else dist.group.WORLD
