"""LLMEngine: the scheduler loop on rank 0 (its own thread): schedule one token budget, run it as
one packed step, sample, stream.

Requests and aborts arrive through a thread-safe inbox and join or leave between steps. The loop
also sends heartbeats and polls control commands, so a stuck loop goes silent to the supervisor.
The core link's requests arrive unbuilt (`put_later`): this thread makes their Sequences while
the device runs the step it just launched, instead of the link's thread making them under the
same GIL while this one schedules (an H200 failover's first admission step waited 8.8 and 14.7 ms
so: bench/RESULTS.md, seventeenth session).

Steps overlap (engines/core/inflight.py): a step launches its work, whose decode rows read their input
ids from the previous step's sampled tokens still on the device, and only then reads the previous
step's tokens on the host and applies the stop rules. A sequence that stopped on the previous
token has computed one token too many, which is dropped; its KV blocks are reused only by work
queued after that step, so stream order keeps the cache right.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from daemon.kv_index import FencedError, PreviousWriterAlive

from engines.kv.integrity import KVIntegrity

from .control import ControlChannel
from .inflight import InFlight
from .tail_publisher import TailPublisher, name_tails
from .promotion_trace import PromotionTrace
from .step_observers import PromotionTiming, StepObservers
from wire.block_keys import key_root
from .block_manager import BlockManager
from .runner import ModelRunner, Step
from .sample_guard import guarded_sample
from .sampling import Sampler, SamplingParams, ensure_seed
from .scheduler import Scheduled, Scheduler
from .seq_stalls import SequenceStalls
from .sequence import Output, Sequence
from .shared_pool import SharedPool
from .tokenizer import Tokenizer

log = logging.getLogger("engines.core.engine")
REHEARSAL_S = 1.0
GRAPH_CATCHUP_S = 1.0  # with work waiting, a deferred CUDA graph is captured at most once this often


class LLMEngine:
    """Continuous-batching generation over a ModelRunner; thread-safe `submit`/`abort`."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, max_model_len: int, max_num_seqs: int,
                 control: ControlChannel | None = None, heartbeat_interval_s: float = 0.5,
                 prefix_caching: bool = True, pool: SharedPool | None = None):
        self.runner, self.tokenizer, self.max_model_len = runner, tokenizer, max_model_len
        self.pool = pool  # the shared KV pool (parked until promoted), or None: our own KV cache
        self.blocks = pool.block_manager(prefix_caching) if pool else BlockManager(
            runner.num_blocks, runner.block_size, prefix_caching)
        self.blocks.on_continuation = self._continued
        self.blocks.root = key_root(runner.deterministic)
        if pool is not None:  # the pool's blocks are checked before reuse (engines/kv/integrity.py)
            self.blocks.integrity = KVIntegrity(runner.model.kv_cache)
        self.continuations = self.continuation_reused = self.continuation_recomputed = 0
        self._continued_now: list[list[int]] = []  # this step's continuations: [reused, recomputed] each
        self.trace = PromotionTrace()  # the first second after a promotion, logged
        self.observers = StepObservers()  # the step's diagnostics (engines/core/step_observers.py)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, runner.max_rows)
        self.stalls = SequenceStalls(self.scheduler, self.blocks)  # (a sequence left out: logged)
        self.tails = TailPublisher(self.blocks) if pool is not None and pool.tails else None
        self.sampler = Sampler()
        self.control = control
        self.heartbeat_interval_s = heartbeat_interval_s
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self.steps = 0
        self.served = 0
        self.generated_tokens = 0  # tokens appended to sequences since start (output tok/s, in heartbeats)
        self.draining = False
        self.stopped = threading.Event()  # set when the loop has exited
        self.on_drained: Callable[[], None] | None = None
        self.on_drain_begin: Callable[[], None] | None = None
        self.on_stats: Callable[[dict], None] | None = None  # every heartbeat interval, from the loop
        self.last_tick = time.monotonic()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_hb = 0.0
        self._rehearsed = 0.0  # (monotonic) a parked standby's last rehearsal of its promotion
        self._captured = 0.0  # (monotonic) the last deferred CUDA graph's capture
        self._device = runner.device
        self.deliver: Callable[[list[tuple[Callable[[Output], None], Output]]], None] | None = None
        self._outbox: list[tuple[Callable[[Output], None], Output]] = []  # this step's outputs, in order
        self._inflight: InFlight | None = None  # the last step's sampled tokens, read back by the next step
        self._pending: dict[int, int] = {}  # seq_id -> its row in self._inflight.tokens
        self._arrived: list[tuple[str, object]] = []  # inbox items taken (and built) during the last step
        if control is not None:  # commands wake the loop through the inbox (engines/core/control.py)
            control.on_command(lambda cmd: self.inbox.put(("cmd", cmd)))

    # ---- API (any thread) ------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Output], None],
               group: int | None = None, replayed: int = 0, prefix_keys: bytes | None = None) -> int:
        """Queue a sequence; `emit` is called with each Output, on the loop thread unless `deliver`
        is set (then once per step, in one batch). Returns its id. Sequences of one request share a
        `group` (they take turns with other requests). `replayed`: the last ids of `prompt_ids` are
        generated tokens of a continued request; `prefix_keys`: its prompt's block keys, hashed
        elsewhere (block_manager.prompt_keys; ignored unless they are as many as its full blocks)."""
        seq = self.sequence(prompt_ids, params, emit, group, replayed, prefix_keys)
        self.inbox.put(("add", seq))
        return seq.seq_id

    def sequence(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Output], None],
                 group: int | None = None, replayed: int = 0, prefix_keys: bytes | None = None,
                 seq_id: int | None = None) -> Sequence:
        """The Sequence `submit` queues, not queued yet (for `put_later`)."""
        return Sequence(prompt_ids, ensure_seed(params), self.tokenizer, self.eos_ids, self.max_model_len,
                        lambda out: self._outbox.append((emit, out)), group, replayed=replayed,
                        prefix_keys=prefix_keys, seq_id=seq_id)

    def put_later(self, build: Callable[[], list[tuple[str, object]]]) -> None:
        """Queue what `build()` returns, inbox items (("add", Sequence), ("abort", seq_id)) taken in
        order between the same two steps (a failover's continuations, sent together, start in the
        same step). The loop calls `build` itself, while the device runs a step if one is in flight."""
        self.inbox.put(("later", build))

    def abort(self, seq_id: int) -> None:
        self.inbox.put(("abort", seq_id))

    def begin_drain(self) -> None:
        """Stop taking requests; the loop exits (calling on_drained) once in-flight ones finish."""
        self.inbox.put(("drain", None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(("noop", None))
        if self._thread:
            self._thread.join(timeout=30)

    def alive(self, stale_after_s: float = 30.0) -> bool:
        """The loop thread runs and has ticked recently (a step longer than `stale_after_s` counts as stuck)."""
        return (self._thread is not None and self._thread.is_alive()
                and time.monotonic() - self.last_tick < stale_after_s)

    def stats(self) -> dict:
        b = self.blocks
        return {"steps": self.steps, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "served": self.served,
                "kv_blocks_used": b.used, "kv_blocks_total": b.usable_blocks,
                "prefix_queried_tokens": b.queried_tokens, "prefix_hit_tokens": b.hit_tokens,
                "preemptions": self.scheduler.preemptions, "generated_tokens": self.generated_tokens,
                "kv_mode": b.mode, "deterministic": self.runner.deterministic, "kv_quarantined_blocks": len(b.quarantined), "continuations": self.continuations,
                "cuda_graphs_pending": len(self.runner.pending_graphs),
                "continuation_reused_tokens": self.continuation_reused,
                "continuation_recomputed_tokens": self.continuation_recomputed,
                "kv_checked_blocks": b.integrity.checked if b.integrity else 0,
                "kv_corrupt_blocks": b.integrity.mismatches if b.integrity else 0,
                "gpu_reserved_bytes": torch.cuda.memory_reserved(self._device) if self._device.type == "cuda" else 0}

    # ---- synchronous use (bench, tests) ----------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion on the calling thread (the loop thread must not be running)."""
        self._bind_device()
        seqs = []
        for ids in prompts:
            seq = Sequence(ids, ensure_seed(params), self.tokenizer, self.eos_ids, self.max_model_len,
                           lambda o: None)
            self.scheduler.add(seq)
            seqs.append(seq)
        while self.has_work:
            self.step()
        return [s.output_ids for s in seqs]

    def _bind_device(self) -> None:
        """Make the engine's GPU this thread's current device (it is per thread: kernels launched
        and events recorded without an explicit device go to the current one)."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    @property
    def has_work(self) -> bool:
        """Sequences wait or run, or sampled tokens are still to be read."""
        return self.scheduler.has_work or self._inflight is not None

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._bind_device()
            while not self._stop:
                self.last_tick = time.monotonic()
                self._heartbeat()
                self._rehearse()
                self.stalls.look(self.last_tick, self.steps)
                self._take_inbox(not self.has_work and not self.runner.pending_graphs)
                self._capture_deferred()
                if self.has_work:
                    self.step()
                elif self.draining:
                    log.info("drained: no requests in flight")
                    if self.on_drained:
                        self.on_drained()
                    return
        except FencedError as e:  # another engine holds the KV pool now: never write it again
            log.error("fenced: %s; stopping", e)
        except Exception:  # the main thread sees `stopped` without `draining` and exits 1
            log.exception("scheduler loop crashed")
        finally:
            self.stopped.set()

    def _take_inbox(self, block: bool) -> None:
        """Take every inbox item, in order: those taken during the last step first. Waits up to a
        heartbeat interval (at most 0.1 s) for one if `block` and none is here."""
        items = self._arrivals(min(self.heartbeat_interval_s, 0.1) if block else None)
        while items:
            for kind, obj in items:
                self._take(kind, obj)
            items = self._arrivals(None)
        self._flush()

    def _arrivals(self, wait_s: float | None) -> list[tuple[str, object]]:
        """The items taken during the last step, then the inbox's (a `later` one built into its
        items); waits up to `wait_s` for one if there are none."""
        items, self._arrived = self._arrived, []
        if items:
            wait_s = None
        while True:
            try:
                kind, obj = self.inbox.get(timeout=wait_s) if wait_s else self.inbox.get_nowait()
            except queue.Empty:
                return items
            wait_s = None
            if kind != "later":
                items.append((kind, obj))
                continue
            try:
                items += obj()  # type: ignore[operator]
            except Exception:  # noqa: BLE001 (a bug in one message's build must not stop the loop)
                log.exception("building the front end's requests failed; they are left out")

    def _take(self, kind: str, obj: object) -> None:
        if kind == "add":
            self._admit(obj)  # type: ignore[arg-type]
        elif kind == "abort":
            seq = self.scheduler.abort(obj)  # type: ignore[arg-type]
            if seq is not None:
                seq.abort()
        elif kind == "cmd":
            self.command(obj)  # type: ignore[arg-type]
        elif kind == "drain":
            self._start_draining()

    def _admit(self, seq: Sequence) -> None:
        """Queue a sequence, unless it could never fit a parked standby's scratch blocks."""
        b = self.blocks
        if b.mode == "parked" and b.blocks_for(min(len(seq.prompt_ids) + seq.params.max_tokens,
                                                   self.max_model_len)) > b.usable_blocks:
            seq.fail(f"this engine is a parked standby: until promoted it serves only requests within its "
                     f"{b.usable_blocks * b.block_size}-token scratch KV (its canary)", "parked")
            return
        self.scheduler.add(seq)

    # ---- control commands (the supervisor) -------------------------------------------------
    def command(self, cmd: dict) -> None:
        """One supervisor command, between steps: drain, promote, demote, fenced."""
        kind = cmd["cmd"]
        if kind == "drain":
            self._start_draining()
        elif kind == "promote":
            self.promote()
        elif kind == "demote":
            self._reply("demoted", **self.demote())
        elif kind == "fenced":
            n = self.blocks.unquarantine()
            if n:
                log.info("the previous KV writer is gone: %d quarantined blocks are free", n)
        else:
            log.warning("unknown control command %r ignored", kind)

    def _reply(self, msg_type: str, **fields) -> None:
        if self.control is not None:
            self.control.send(msg_type, **fields)

    def promote(self) -> None:
        """Take the shared pool's writer role and say `promoted` (or `promote_failed` if the previous
        writer was not fenced), then adopt what the pool holds and say `adopted` with its report: the
        supervisor routes to us while we read the index (with our own KV cache, or the pool already
        ours, `promoted` only)."""
        if self.pool is None or self.blocks.mode == "writer":  # (nothing to take or read: no `adopted`)
            self._reply("promoted", kv_mode=self.blocks.mode, adopted_blocks=0, seconds=0.0)
            return
        try:
            taken = self.pool.take()
        except PreviousWriterAlive as e:
            log.error("promotion refused: %s", e)
            self._reply("promote_failed", error=str(e))
            return
        self._reply("promoted", kv_mode="writer", pool_epoch=taken["pool_epoch"], seconds=taken["seconds"],
                    claim_wait_seconds=taken["claim_wait_seconds"])
        report = self.pool.adopt(self.blocks, self._device, taken)
        self.trace.arm(self._reserved())
        if not any(isinstance(o, PromotionTiming) for o in self.observers):  # (armed again: the same one times)
            self.observers.append(PromotionTiming(self.trace, self._reserved))
        log.info("promoted: KV writer at pool epoch %d, adopted %d keyed blocks, %d free, %d quarantined, %d tails "
                 "(%.1f ms: the role %.1f, answered then; the claim %.1f, of which waiting for the previous writer "
                 "%.1f, the keys' sort %.1f: %.1f on CPU, %d page faults)", report["pool_epoch"],
                 report["adopted_blocks"], report["free_blocks"], report["quarantined_blocks"], report["tails"],
                 report["seconds"] * 1e3, report["take_seconds"] * 1e3, report["claim_seconds"] * 1e3,
                 report["claim_wait_seconds"] * 1e3, report["claim_sort_seconds"] * 1e3,
                 report["claim_sort_cpu_seconds"] * 1e3, report["claim_sort_faults"])
        self._reply("adopted", kv_mode="writer", **report)

    def demote(self) -> dict:
        """A planned switchover: finish the step in flight, seal what it filled, name every running
        sequence's tail, hand every request off (the router continues it on the new primary), give the
        writer role up."""
        if self.pool is None or self.blocks.mode != "writer":
            return {"handed_off": 0, "tails": 0}
        self._read_back()
        if self.tails is not None:
            self.tails.publish()
        # (every step it launched has completed: all of their positions; finished ones are not continued)
        tails = name_tails(self.blocks, [s for s in self.scheduler.running if s.finish_reason is None])
        seqs = self.scheduler.take_all()
        for seq in seqs:
            if seq.finish_reason is None:
                seq.hand_off()
        self.pool.demote(self.blocks)
        self._flush()
        log.info("demoted: handed %d requests off (%d tails named); parked", len(seqs), tails)
        return {"handed_off": len(seqs), "tails": tails}

    def _continued(self, reused: int, recomputed: int) -> None:
        """A continued request found `reused` of its tokens' KV in the pool and recomputes the rest
        (reported after the step: `_report_continued`)."""
        self.continuations += 1
        self.continuation_reused += reused
        self.continuation_recomputed += recomputed
        self.trace.continued()
        self._continued_now.append([reused, recomputed])

    def _report_continued(self) -> None:
        """This step's continuations, in one message (a failover's 256 are a few steps' worth, not
        256 messages through the supervisor's loop while it continues their streams)."""
        if self._continued_now:
            each, self._continued_now = self._continued_now, []
            self._reply("continuations", each=each)

    def _flush(self) -> None:
        """Hand this step's outputs over: in one batch to `deliver`, else one by one."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        if self.deliver is not None:
            self.deliver(batch)
        else:
            for emit, out in batch:
                emit(out)

    def _start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining: %d running, %d waiting", len(self.scheduler.running), len(self.scheduler.waiting))
            if self.on_drain_begin:
                self.on_drain_begin()

    def _rehearse(self) -> None:
        """A parked standby with no work reads the pool's index as its promotion will, once a
        REHEARSAL_S: the memory that read needs is then this process's already (engines/core/heap.py)."""
        now = time.monotonic()
        if self.pool is not None and self.blocks.mode == "parked" and not self.has_work \
                and now - self._rehearsed >= REHEARSAL_S:
            self._rehearsed = now
            self.pool.rehearse()

    def _capture_deferred(self) -> None:
        """One of the CUDA graphs the engine left for later to be ready sooner (engines/core/runner.py
        `capture_graphs`): at once when it has no work, else at most once a GRAPH_CATCHUP_S, after the
        step in flight is read back (the running streams then wait one capture, ~0.1 s)."""
        if not self.runner.pending_graphs or self.draining or (
                self.has_work and time.monotonic() - self._captured < GRAPH_CATCHUP_S):
            return
        self._read_back()
        self._flush()
        self.runner.capture_next_graph()
        self._captured = time.monotonic()
        if not self.runner.pending_graphs:
            self._last_hb = 0.0  # (the next heartbeat at once: the supervisor and /health see it now)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= self.heartbeat_interval_s:
            self._last_hb = now
            stats = self.stats()
            if self.control:
                self.control.send("heartbeat", **stats)
            if self.on_stats:
                self.on_stats(stats)

    def step(self) -> None:
        """One scheduler step: schedule, launch the work, read the previous step's tokens back (the
        arrivals are built meanwhile), key and publish what completed, release the finished.
        Diagnostics observe it through `observers` (engines/core/step_observers.py)."""
        self.observers.at("began")
        work = self._schedule()
        self.observers.at("scheduled")
        self._flush()  # (first-run markers out before the step runs: the router sees who ran when it dies)
        step, launch = self._launch(work)
        self.observers.at("sampled")
        self._arrived = self._arrivals(None)  # (their Sequences made while the device computes)
        self.observers.at("built")
        before = self._inflight
        self._read_back()
        self.observers.at("read_back")
        self._publish(work, step, before)
        self._inflight = launch
        self._pending = {s.seq_id: row for row, s in enumerate(launch.seqs)} if launch else {}
        self.served += len(self.scheduler.release_finished())
        self.steps += 1
        self._flush()
        self._report_continued()
        self.observers.ended(work)

    def _schedule(self) -> list[Scheduled]:
        """This step's work, and the continuations' tails copied before any step reads them."""
        work = self.scheduler.schedule()
        if self.blocks.copies:
            self.runner.copy_blocks(self.blocks.take_copies())
        return work

    def _launch(self, work: list[Scheduled]) -> tuple[Step | None, InFlight | None]:
        """Pack, run and sample `work` on the device, not waiting for it (None, None: no work)."""
        if not work:
            self.observers.at("prepared")
            self.observers.at("run")
            return None, None
        if self.runner.tp_size > 1:
            self._read_back()  # workers need every input token on the host: no overlap under TP
        step = self.runner.prepare(work, self._pending)
        self.observers.at("prepared")
        logits, picks = self.runner.run(step, self._inflight.tokens if self._inflight else None)
        self.observers.at("run")
        launch = self._sample([w for w in work if w.samples], logits, picks)
        self.blocks.launched(launch.ready)  # (recorded after the step's kernels and its tokens' copy)
        return step, launch

    def _publish(self, work: list[Scheduled], step: Step | None, before: InFlight | None) -> None:
        """The step before this one has completed (its tokens were just read back): name the tails,
        key the blocks this step's work filled, publish what completed steps sealed and freed (before
        this step's outputs go out: engines/core/block_manager.py)."""
        if self.tails is not None:
            self.tails.publish()
        for w in work:  # their input tokens are all known now
            self.blocks.seal(w.seq)
        # the read back waited for `before` (under TP it read back before the launch: `before` is None, the
        # publisher queries)
        self.blocks.publish_completed(before.ready if before is not None else None)
        if step is not None and self.tails is not None:
            self.tails.record(work, *step.rows(), step.pending_rows, step.pending_src, step.pending_in_order,
                              before.host.numpy() if before is not None else None)

    def _reserved(self) -> int | None:
        """The device bytes torch's caching allocator holds (None off CUDA)."""
        return torch.cuda.memory_reserved(self._device) if self._device.type == "cuda" else None

    def _read_back(self) -> None:
        """Apply the last step's tokens to their sequences (dropping those of finished ones)."""
        if self._inflight is None:
            return
        launch = self._inflight
        tokens = launch.wait()
        appended = 0
        for row, (seq, tok) in enumerate(zip(launch.seqs, tokens)):
            seq.unread -= 1
            if seq.finish_reason is None:
                if tok < 0:  # sampling errors fail their request, never the loop
                    seq.fail(launch.why_failed(row))
                else:
                    seq.append(tok)
                    appended += 1
        self.generated_tokens += appended
        self._inflight, self._pending = None, {}

    def _sample(self, work: list[Scheduled], logits: torch.Tensor, picks: torch.Tensor) -> InFlight:
        """Launch the draw of each sequence's next token: a function of (seed, its position)."""
        seqs = [w.seq for w in work]
        tokens, read_back, errors = guarded_sample(self.sampler, logits, picks, [s.params for s in seqs],
                                                   [w.start + w.num_new for w in work])
        for s in seqs:
            s.unread += 1
        return InFlight.launch(seqs, tokens, read_back, errors)
