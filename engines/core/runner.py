"""ModelRunner: runs one packed step (decode rows and prefill chunks together) on one rank, over a
paged KV cache; CUDA graphs for decode-only steps at a set of batch sizes.

Every host-to-device input of a step (token ids, positions, cache rows, query starts, sequence
lengths, block tables, logit rows) is written into one persistent pinned buffer and reaches the
device in one copy, into a persistent device buffer the model (or a captured graph) reads.
Decode rows whose input token is still on the device (sampled by the previous step, not yet read
back) take it from there with one gather, so steps overlap.

Under tensor parallelism rank 0 broadcasts every step (a small header, then the packed buffer)
on a gloo group before running it, and ranks 1..N-1 sit in `worker_loop` running the same step so
the model's collectives line up. Only rank 0 samples.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from daemon.kv_attach import KVPoolMapping

from .block_manager import PAD_BLOCK
from .device_upload import to_device
from models import AttnMeta, CausalLM
from models.paged import query_blocks
from models.fused_decode import FUSED_MAX_BATCH, fused_decode_unavailable
from models.args import deterministic_refusal
from .sample_guard import greedy_picks
from .scheduler import Scheduled

log = logging.getLogger("engines.core.runner")

EXIT, STEP, COPY = 0, 1, 2
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
GRAPH_TOKEN_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE, MIXED = 1, 2  # graph kinds: decode-only steps by sequence count, mixed steps by row count


class KVBudgetError(ValueError):
    """kv_cache_bytes cannot hold even one sequence of max_model_len tokens."""


@dataclass(frozen=True)
class Layout:
    """Offsets of a step's inputs inside the packed int64 buffer (t rows, b sequences). The block
    tables come first, so sequence i's row sits at the same place whatever the step's size: a row
    written for one step is still right for the next (the runner rewrites only what changed)."""

    t: int
    b: int
    max_blocks: int

    @property
    def ids(self) -> int: return self.b * self.max_blocks
    @property
    def pos(self) -> int: return self.ids + self.t
    @property
    def slots(self) -> int: return self.ids + 2 * self.t
    @property
    def cu_q(self) -> int: return self.ids + 3 * self.t
    @property
    def cu_qb(self) -> int: return self.cu_q + self.b + 1
    @property
    def seq_lens(self) -> int: return self.cu_qb + self.b + 1
    @property
    def logit_rows(self) -> int: return self.seq_lens + self.b
    @property
    def size(self) -> int: return self.logit_rows + self.b

    def views(self, buf: torch.Tensor, num_logits: int | None, num_programs: int, block_q: int,
              max_q_len: int, search_steps: int) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
        """(input ids, positions, attention metadata) over `buf` in this layout."""
        t, b = self.t, self.b
        meta = AttnMeta(slot_mapping=buf[self.slots:self.slots + t], cu_q=buf[self.cu_q:self.cu_q + b + 1],
                        seq_lens=buf[self.seq_lens:self.seq_lens + b],
                        block_tables=buf[:self.ids].view(b, self.max_blocks), max_q_len=max_q_len,
                        cu_qblocks=buf[self.cu_qb:self.cu_qb + b + 1], num_programs=num_programs,
                        block_q=block_q, search_steps=search_steps,
                        logit_rows=None if num_logits is None else buf[self.logit_rows:self.logit_rows + num_logits])
        return buf[self.ids:self.ids + t], buf[self.pos:self.pos + t], meta


@dataclass
class Step:
    """A packed step on the host, ready to run."""

    layout: Layout
    num_rows: int  # real rows (a graph step pads up to layout.t)
    num_seqs: int  # real sequences (a graph step pads up to layout.b)
    max_q_len: int
    num_logits: int
    graph: tuple[int, int] | None  # (DECODE | MIXED, size) of the captured graph that runs it
    host: torch.Tensor  # the pinned buffer it was packed in
    block_q: int
    num_programs: int
    q_lens: list[int]
    seq_lens: list[int]
    pending_rows: list[int] = field(default_factory=list)  # rows whose input token is the previous step's
    pending_src: list[int] = field(default_factory=list)  # sampled token at these rows of its tokens

    @cached_property
    def pending_in_order(self) -> bool:
        """Pending row i takes the previous step's sampled token i, for every i: the same sequences in
        the same order as that step (the steady state). Read once the step is packed."""
        return self.pending_rows == self.pending_src == list(range(len(self.pending_rows)))

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The KV slot and the input token id of each real row (views of the packed buffer; a
        pending row's id is 0 here)."""
        h, lay = self.host.numpy(), self.layout
        return h[lay.slots:lay.slots + self.num_rows], h[lay.ids:lay.ids + self.num_rows]

    def header(self) -> list[int]:
        kind, size = self.graph or (0, 0)
        return [STEP, self.layout.t, self.layout.b, self.num_rows, self.num_seqs, self.max_q_len, self.num_logits,
                kind, size, self.block_q, self.num_programs]


class ModelRunner:
    """Owns the model on one rank, its paged KV cache, the step buffers and the CUDA graphs."""

    def __init__(self, model: CausalLM, device: torch.device, rank: int = 0, tp_size: int = 1,
                 ctrl_group: dist.ProcessGroup | None = None, fused_kernels: bool = True,
                 deterministic: bool = False):
        if deterministic and (beyond := model.args.beyond_plain()) is not None:
            raise ValueError(deterministic_refusal(beyond))
        self.model, self.device, self.rank, self.tp_size = model, device, rank, tp_size
        self.ctrl_group = ctrl_group
        self.fused_kernels = fused_kernels and not deterministic  # batch-1 kernels sum in another order
        self.deterministic = model.deterministic = deterministic  # batch-invariant ops (models/invariant.py)
        attn = model.model.layers[0].self_attn
        self.deterministic_status = "on" if deterministic else "off"
        if deterministic and device.type == "cpu":
            from models.invariant import check_cpu_tiles
            tiles = check_cpu_tiles(model)
            self.deterministic_status = ("on (CPU: torch on fixed tiles, checked bit-identical at every place)" if tiles
                                         else "on (CPU: rows one by one: this BLAS sums a row by its place in a tile)")
        if deterministic and device.type == "cuda":
            from models.kernels.paged_attention import check_query_tiles
            from models.invariant_forward import check_product_tiles
            products = check_product_tiles(model)
            attention = check_query_tiles(attn.heads, attn.kv_heads, attn.head_dim, model.dtype, device)
            self.deterministic_status = (f"on (tiles by the batch, checked bit-identical: products {products}, "
                                         f"attention {attention})")
            if not products or not attention:
                log.warning("deterministic: on this GPU the tile or the split changes a row's bits (products "
                            "bit-identical: %s, attention: %s); products take one tile for every batch, attention "
                            "one program per row (slower decode, the same text)", products, attention)
        self.fused_decode_status = "off (no KV cache yet)"
        self.num_blocks = 0
        self.block_size = 0
        self.max_blocks = 0
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._sizes_by_kind: dict[int, list[int]] = {DECODE: [], MIXED: []}  # captured sizes per kind, ascending
        self.pending_graphs: list[tuple[int, int]] = []  # to capture yet, in order (capture_graphs' `defer`)
        self._graph_pool, self._warmed = None, set()  # the graphs' one memory pool; forward paths warmed up
        group = triton_pow2(attn.heads // attn.kv_heads)
        # query rows per attention program, decode-only step or not (paged_attention.query_block: a
        # deterministic engine's prefill takes decode's)
        self.block_q = {True: max(1, 16 // group), False: max(1, (16 if deterministic else 64) // group)}

    @property
    def graph_sizes(self) -> dict[str, list[int]]:
        return {kind: sorted(s for k, s in self.graphs if k == code) for kind, code in (("decode", DECODE),
                                                                                       ("mixed", MIXED))}

    # ---- setup -----------------------------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
                          max_num_batched_tokens: int, pool: KVPoolMapping | None = None) -> int:
        """Split the byte budget into blocks (one more for padding rows) and allocate them, or run on
        a shared pool's blocks; returns the block count."""
        per_block = self.model.kv_bytes_per_block(block_size)
        self.max_blocks = -(-max_model_len // block_size)
        if pool is None:
            blocks = kv_cache_bytes // per_block
            what, usable = f"kv_cache_bytes={kv_cache_bytes}", blocks - 1
        else:
            blocks = pool.layout.num_blocks
            what, usable = f"the shared KV pool ({blocks * per_block} bytes)", len(pool.layout.shared_blocks)
        if usable < self.max_blocks:
            raise KVBudgetError(
                f"{what} cannot hold one sequence of max_model_len={max_model_len} ({self.max_blocks} blocks of "
                f"{block_size} tokens, {self.max_blocks * per_block} bytes on this rank, beyond the padding and "
                f"scratch blocks; it has {max(usable, 0)}); raise kv_cache_bytes or lower max_model_len")
        if pool is None:
            self.model.allocate_kv_cache(blocks, block_size, self.device)
        else:
            layout = pool.layout
            kv = pool.region[:layout.pool_bytes].view(self.model.dtype).view(layout.shape)
            self.model.use_kv_cache(kv, block_size)
            self.kv_pool = pool  # keeps the mapping alive
        self.num_blocks, self.block_size = blocks, block_size
        self.max_rows = max(max_num_batched_tokens, max_num_seqs)
        self.max_seqs = max_num_seqs
        self.search_steps = max_num_seqs.bit_length()
        cap = Layout(self.max_rows, max_num_seqs, self.max_blocks).size
        # Two pinned buffers, used in turn: a step is packed while the previous one's copy may not have run.
        self._hosts = [torch.zeros(cap, dtype=torch.long, pin_memory=self.device.type == "cuda") for _ in range(2)]
        self._turn = 0
        self._tables_written: list[list[tuple[list[int], int]]] = [[], []]  # per buffer, see _write_tables
        self._arange = np.arange(self.max_rows + 1)
        self._dev = torch.zeros(cap, dtype=torch.long, device=self.device)
        layer = self.model.kv_cache[0]  # [2, blocks, block_size, heads, dim]
        self._copy_buffer = torch.empty(layer[:, :max_num_seqs].numel(), dtype=layer.dtype, device=self.device)
        if self.device.type == "cuda":
            self._warm_index_kernels()
        reason = ("deterministic" if self.deterministic else "fused_kernels is false") if not self.fused_kernels \
            else fused_decode_unavailable(self.model)
        self.model.use_fused_decode = reason is None
        self.fused_decode_status = f"off ({reason})" if reason else f"on (batches up to {FUSED_MAX_BATCH})"
        return blocks

    def capture_graphs(self, defer: bool = False) -> dict[str, list[int]]:
        """Capture decode-only graphs per sequence count up to max_num_seqs, and mixed-step graphs
        per row count up to the step budget (largest first, one memory pool). `defer`: only the largest
        of each kind now (every step fits one of them), the others left in `pending_graphs` for
        `capture_next_graph` (the engine's loop: engines/core/engine.py), so that an engine is ready
        sooner after a restart.

        An eager warm-up run (Triton's compiles, NCCL's setup, the BLAS library's first calls) goes
        before the first graph of each forward path only (mixed, decode, fused decode): the
        smaller graphs of a path run the same kernels, and the first calls a new shape still makes
        (~2 ms of host time per product) are taken in its capture. A warm-up before every graph
        made a restart's capture ~25% longer (H200: bench/HISTORY.md, the graph warm-up probe, removed since)."""
        if self.device.type != "cuda":
            return self.graph_sizes
        decode = sorted({b for b in GRAPH_BATCH_SIZES if b < self.max_seqs} | {self.max_seqs})
        mixed = sorted({t for t in GRAPH_TOKEN_SIZES if t < self.max_rows} | {self.max_rows})
        self.pending_graphs = [(MIXED, t) for t in reversed(mixed)] + [(DECODE, b) for b in reversed(decode)]
        now = [(MIXED, mixed[-1]), (DECODE, decode[-1])] if defer else list(self.pending_graphs)
        times = [self._capture(key) for key in now]
        log.info("captured %d graphs: warm-up runs %.3f s, captures %.3f s (ms each: %s)%s", len(times),
                 sum(t[1] for t in times), sum(t[2] for t in times), ", ".join(t[0] for t in times),
                 f"; {len(self.pending_graphs)} more when the engine has time" if self.pending_graphs else "")
        return self.graph_sizes

    def capture_next_graph(self) -> None:
        """Capture the first of `pending_graphs` (with no step in flight)."""
        self._capture(self.pending_graphs[0])
        if not self.pending_graphs:
            log.info("CUDA graphs: all %d captured %s", len(self.graphs), self.graph_sizes)

    def _capture(self, key: tuple[int, int]) -> tuple[str, float, float]:
        """Capture one graph into the shared pool: (its label and ms, warm-up s, capture s)."""
        t0 = time.perf_counter()
        step = self._padding_step(key)
        ids, pos, meta = self._views(step)
        path = (key[0], key[0] == DECODE and key[1] <= FUSED_MAX_BATCH and self.model.use_fused_decode)
        if path not in self._warmed:
            self._warmed.add(path)
            self._forward(ids, pos, meta)
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._forward(ids, pos, meta)
        torch.cuda.synchronize(self.device)
        self._graph_pool = graph.pool()
        self.graphs[key] = (graph, out)
        self.pending_graphs.remove(key)
        self._sizes_by_kind = {k: [s for kk, s in sorted(self.graphs) if kk == k] for k in (DECODE, MIXED)}
        t2 = time.perf_counter()
        return f"{'decode' if key[0] == DECODE else 'mixed'} {key[1]} {(t2 - t1) * 1e3:.0f}", t1 - t0, t2 - t1

    def replay_graphs(self) -> None:
        """Replay every captured graph once on padding (rows that write only the padding block), as
        its capture's warm-up ran: a graph's first replay then comes before serving."""
        for key, (graph, _) in self.graphs.items():
            self._padding_step(key)
            graph.replay()

    def _padding_step(self, key: tuple[int, int]) -> Step:
        """Graph `key`'s layout filled with padding only, in host buffer 0 and on the device (a capture's
        or a replay's input). That padding may overlie rows of block tables a step wrote into buffer 0:
        its record of them is cleared, so the next step on it rewrites them all."""
        host = self._hosts[0]
        step = self._graph_step(key, host)
        self._pad(host.numpy(), step, 0, 0, 0)
        self._tables_written[0].clear()
        self._dev[:step.layout.size].copy_(host[:step.layout.size])
        return step

    def _warm_index_kernels(self) -> None:
        """Copy padding blocks and gather tokens once with one index and once with max_num_seqs (the
        most a step uploads): CUDA loads a kernel on its first call (index_select's took 63.5 ms behind
        queued work on an H100, bench/probes/first_kernel.py), and index_select has one kernel for up
        to 16 indices and another for more. No block or token changes."""
        for n in sorted({1, self.max_seqs}):
            self._copy_blocks([PAD_BLOCK] * 2 * n)
            prev = torch.zeros(n, dtype=torch.long, device=self.device)
            rows = list(range(n - 1, -1, -1))
            self._gather_pending(torch.zeros_like(prev), rows, rows[::-1], prev, in_order=False)

    def _graph_step(self, key: tuple[int, int], host: torch.Tensor) -> Step:
        kind, size = key
        decode = kind == DECODE
        layout = Layout(size, size if decode else self.max_seqs, self.max_blocks)
        bq = self.block_q[decode]
        return Step(layout, 0, 0, 1 if decode else size, layout.b, key, host, bq,
                    -(-layout.t // bq) + layout.b, [], [])

    # ---- steps (rank 0) --------------------------------------------------------------------
    def prepare(self, work: list[Scheduled], pending: dict[int, int]) -> Step:
        """Pack the scheduled work into a pinned buffer. `pending` maps a sequence id to the row
        of the previous step's sampled tokens holding its unread last token."""
        q_lens = [w.num_new for w in work]
        rows, max_q, b = sum(q_lens), max(q_lens), len(work)
        self._turn ^= 1
        host = self._hosts[self._turn]
        key = self._graph_for(rows, b, max_q)
        if key is not None:
            step = self._graph_step(key, host)
        else:
            step = Step(Layout(rows, b, self.max_blocks), rows, b, max_q, 0, None, host, self.block_q[max_q == 1],
                        0, [], [])
        layout, h, bs = step.layout, host.numpy(), self.block_size
        self._write_tables(h, work)
        ids, pos, slots, seq_lens, logit_rows = [], [], [], [], []
        row = 0
        for w in work:
            seq, start, n = w.seq, w.start, w.num_new
            end = start + n
            if n == 1:
                pos.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                p = np.arange(start, end)
                pos.extend(p.tolist())
                slots.extend((np.asarray(seq.block_table)[p // bs] * bs + p % bs).tolist())
            known = seq.num_tokens
            if end <= known:
                ids.extend(seq.token_ids(start, end))
            else:  # its last token is still on the device
                ids.extend(seq.token_ids(start, known))
                ids.append(0)
                step.pending_rows.append(row + n - 1)
                step.pending_src.append(pending[seq.seq_id])
            row += n
            seq_lens.append(end)
            if end == known + seq.unread:  # the chunk reaches the sequence's end: its last row samples
                logit_rows.append(row - 1)
        cu_q = self._arange[:b + 1] if max_q == 1 else np.cumsum([0] + q_lens)
        cu_qb = cu_q if step.block_q == 1 or max_q == 1 else query_blocks(q_lens, step.block_q)
        at = layout.ids
        h[at:at + rows] = ids
        h[layout.pos:layout.pos + rows] = pos
        h[layout.slots:layout.slots + rows] = slots
        h[layout.cu_q:layout.cu_q + b + 1] = cu_q
        h[layout.cu_qb:layout.cu_qb + b + 1] = cu_qb
        h[layout.seq_lens:layout.seq_lens + b] = seq_lens
        h[layout.logit_rows:layout.logit_rows + len(logit_rows)] = logit_rows
        step.num_rows, step.num_seqs, step.max_q_len = rows, b, max_q
        step.q_lens, step.seq_lens, step.num_logits = q_lens, seq_lens, len(logit_rows)
        if key is not None:
            self._pad(h, step, rows, b, len(logit_rows))
        else:
            step.num_programs = int(cu_qb[-1])
        return step

    def _write_tables(self, h: np.ndarray, work: list[Scheduled]) -> None:
        """Sequence i's block table into row i of this buffer's tables. A block table only grows
        (a preempted sequence gets a new list), so a row that held the same list when this buffer
        was last packed takes only its new entries: most steps write nothing here."""
        written = self._tables_written[self._turn]  # row -> (the list it holds, entries written)
        tables = h[:len(work) * self.max_blocks].reshape(len(work), self.max_blocks)
        for i, w in enumerate(work):
            table = w.seq.block_table
            if i == len(written):
                written.append(([], 0))
            held, done = written[i]
            if held is not table:
                done = 0
            if len(table) > done:
                tables[i, done:len(table)] = table[done:]
            written[i] = (table, len(table))

    def _graph_for(self, rows: int, b: int, max_q: int) -> tuple[int, int] | None:
        """The smallest captured graph that fits the step, if any."""
        kind, n = (DECODE, b) if max_q == 1 else (MIXED, rows)
        sizes = self._sizes_by_kind[kind]
        i = bisect.bisect_left(sizes, n)
        return (kind, sizes[i]) if i < len(sizes) else None

    def run(self, step: Step, prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a prepared step; returns the logits of its sampling rows `[S, vocab]` and their
        greedy picks `[S]` (engines/core/sample_guard.py). Under tensor parallelism every input token
        must be known on the host (no pending rows)."""
        if self.tp_size > 1:
            if step.pending_rows:
                raise RuntimeError("a tensor-parallel step cannot take its input tokens from the device")
            self._broadcast(step.header(), step.host[:step.layout.size])
        return self._execute(step, prev_tokens)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer's keys and values, (source, destination) pairs, before
        the next step (on every rank)."""
        ids = [s for s, _ in pairs] + [d for _, d in pairs]
        if self.tp_size > 1:
            self._broadcast([COPY, len(pairs)] + [0] * (HEADER_LEN - 2), torch.tensor(ids, dtype=torch.long))
        self._copy_blocks(ids)

    def _copy_blocks(self, ids: list[int]) -> None:
        """ids: the sources, then the destinations. One layer's copy at a time, through a buffer kept
        for it (up to max_num_seqs blocks at once): the copy asks torch's allocator for nothing. A
        temporary for it grew the allocator by a 20 MiB segment in a new primary's first large step,
        and those steps' schedule phase stalled (H100, bench/RESULTS.md, twenty-second session)."""
        n, dev = len(ids) // 2, to_device(ids, self.device)
        sources, destinations = dev[:n], dev[n:]
        for at in range(0, n, self.max_seqs):
            src, dst = sources[at:at + self.max_seqs], destinations[at:at + self.max_seqs]
            for layer in self.model.kv_cache:  # [2, blocks, block_size, heads, dim]
                shape = (layer.shape[0], len(src), *layer.shape[2:])
                out = self._copy_buffer[:math.prod(shape)].view(shape)
                torch.index_select(layer, 1, src, out=out)
                layer.index_copy_(1, dst, out)

    def shutdown(self) -> None:
        """Tell the workers to leave their loop (rank 0)."""
        if self.tp_size > 1:
            self._broadcast([EXIT] + [0] * (HEADER_LEN - 1), None)

    # ---- worker ranks ----------------------------------------------------------------------
    def worker_loop(self) -> None:
        """Follow rank 0's steps until it broadcasts EXIT."""
        while True:
            header = torch.zeros(HEADER_LEN, dtype=torch.long)
            dist.broadcast(header, 0, group=self.ctrl_group)
            kind, t, b, rows, seqs, max_q, num_logits, graph_kind, graph_size, bq, programs = header.tolist()
            if kind == EXIT:
                return
            if kind == COPY:
                ids = torch.zeros(2 * t, dtype=torch.long)
                dist.broadcast(ids, 0, group=self.ctrl_group)
                self._copy_blocks(ids.tolist())
                continue
            if kind != STEP:
                raise RuntimeError(f"rank {self.rank}: unknown step kind {kind} from rank 0")
            layout = Layout(t, b, self.max_blocks)
            host = self._hosts[0]
            dist.broadcast(host[:layout.size], 0, group=self.ctrl_group)
            h = host.numpy()
            step = Step(layout, rows, seqs, max_q, num_logits, (graph_kind, graph_size) if graph_kind else None,
                        host, bq, programs, np.diff(h[layout.cu_q:layout.cu_q + seqs + 1]).tolist(),
                        h[layout.seq_lens:layout.seq_lens + seqs].tolist())
            self._execute(step, None)

    # ---- shared ----------------------------------------------------------------------------
    def _pad(self, h: np.ndarray, step: Step, rows: int, b: int, num_logits: int) -> None:
        """Fill a graph layout past the real work: padding rows write to the padding block and
        belong to no sequence; padding sequences own no rows (so no attention programs); padding
        logit rows read row 0."""
        lay = step.layout
        h[lay.ids + rows:lay.ids + lay.t] = 0
        h[lay.pos + rows:lay.pos + lay.t] = 0
        h[lay.slots + rows:lay.slots + lay.t] = PAD_BLOCK * self.block_size
        if b == 0:
            h[lay.cu_q] = h[lay.cu_qb] = 0
        h[lay.cu_q + b + 1:lay.cu_q + lay.b + 1] = rows
        h[lay.cu_qb + b + 1:lay.cu_qb + lay.b + 1] = h[lay.cu_qb + b]
        h[lay.seq_lens + b:lay.seq_lens + lay.b] = 0
        h[lay.logit_rows + num_logits:lay.logit_rows + lay.b] = 0

    def _views(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
        logits = None if step.graph and step.graph[0] == DECODE else (step.layout.b if step.graph else step.num_logits)
        ids, pos, meta = step.layout.views(self._dev, logits, step.num_programs, step.block_q,
                                           step.max_q_len, self.search_steps)
        meta.q_lens_host, meta.seq_lens_host = step.q_lens, step.seq_lens
        return ids, pos, meta

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits and their greedy picks (in the graph, so greedy batches sample for free)."""
        logits = self.model(ids, pos, meta)
        return logits, greedy_picks(logits)

    def _execute(self, step: Step, prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        self._dev[:step.layout.size].copy_(step.host[:step.layout.size], non_blocking=True)  # one copy
        if step.graph:  # the graph reads its inputs from the buffer: no views to build
            if step.pending_rows:
                at = step.layout.ids
                self._gather_pending(self._dev[at:at + step.layout.t], step.pending_rows, step.pending_src, prev_tokens,
                                     step.pending_in_order)
            graph, (logits, picks) = self.graphs[step.graph]
            graph.replay()
            n = step.num_seqs if step.graph[0] == DECODE else step.num_logits
            return logits[:n], picks[:n]
        ids, pos, meta = self._views(step)
        if step.pending_rows:
            self._gather_pending(ids, step.pending_rows, step.pending_src, prev_tokens, step.pending_in_order)
        return self._forward(ids, pos, meta)

    def _gather_pending(self, ids: torch.Tensor, rows: list[int], src: list[int], prev_tokens: torch.Tensor,
                        in_order: bool) -> None:
        """ids[rows[i]] = prev_tokens[src[i]] on the device (the rows whose input is a token not read back
        yet); `in_order`: rows and src are both 0..n-1 (`Step.pending_in_order`)."""
        n = len(rows)
        if in_order:
            ids[:n].copy_(prev_tokens[:n])  # steady state: the same sequences, in the same order
            return
        idx = to_device(rows + src, self.device)
        ids.index_copy_(0, idx[:n], prev_tokens.index_select(0, idx[n:]))

    def _broadcast(self, header: list[int], payload: torch.Tensor | None) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.long), 0, group=self.ctrl_group)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.ctrl_group)


HEADER_LEN = 11


def triton_pow2(n: int) -> int:
    """The next power of two (the kernels pad the GQA group to one)."""
    return 1 << max(0, (n - 1).bit_length())


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
