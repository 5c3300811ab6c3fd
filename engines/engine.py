"""LLMEngine: the scheduler loop on rank 0 (its own thread): admit, prefill, batched decode, sample.

Requests and aborts arrive through a thread-safe inbox and join or leave between steps. The loop
also sends heartbeats and polls control commands, so a stuck loop goes silent to the supervisor.

Steps overlap (engines/inflight.py): a step launches its prefills and its decode, whose input ids
are the previous step's sampled tokens still on the device, and only then reads the previous
step's tokens on the host and applies the stop rules. A sequence that stopped on the previous
token has computed one token too many, which is dropped; its KV slot is reused only by work
queued after that step, so stream order keeps the cache right.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from .control import ControlChannel
from .inflight import InFlight
from .runner import ModelRunner
from .sample_guard import guarded_sample
from .sampling import Sampler, SamplingParams, make_generator, to_device
from .scheduler import Scheduler
from .sequence import Output, Sequence
from .tokenizer import Tokenizer

log = logging.getLogger("engines.engine")


class LLMEngine:
    """Continuous-batching generation over a ModelRunner; thread-safe `submit`/`abort`."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, max_model_len: int, max_num_seqs: int,
                 control: ControlChannel | None = None, heartbeat_interval_s: float = 0.5):
        self.runner, self.tokenizer, self.max_model_len = runner, tokenizer, max_model_len
        self.scheduler = Scheduler(runner.num_slots, max_num_seqs)
        self.sampler = Sampler()
        self.control = control
        self.heartbeat_interval_s = heartbeat_interval_s
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self.steps = 0
        self.served = 0
        self.draining = False
        self.stopped = threading.Event()  # set when the loop has exited
        self.on_drained: Callable[[], None] | None = None
        self.on_drain_begin: Callable[[], None] | None = None
        self.last_tick = time.monotonic()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_hb = 0.0
        self._device = runner.device
        self._inflight: list[InFlight] = []  # the last step's launches, read back by the next step
        self._pending: dict[int, tuple[int, int]] = {}  # seq_id -> (launch, row) of its unread token

    # ---- API (any thread) ------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Output], None]) -> int:
        """Queue a sequence; `emit` is called from the loop thread with each Output. Returns its id."""
        seq = Sequence(prompt_ids, params, self.tokenizer, self.eos_ids, self.max_model_len, emit)
        if not params.greedy:
            seq.generator = make_generator(params.seed, self._device)
        self.inbox.put(("add", seq))
        return seq.seq_id

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
        return {"steps": self.steps, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "served": self.served}

    # ---- synchronous use (bench, tests) ----------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion on the calling thread (the loop thread must not be running)."""
        self._bind_device()
        seqs = []
        for ids in prompts:
            seq = Sequence(ids, params, self.tokenizer, self.eos_ids, self.max_model_len, lambda o: None)
            if not params.greedy:
                seq.generator = make_generator(params.seed, self._device)
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
        return self.scheduler.has_work or bool(self._inflight)

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._bind_device()
            while not self._stop:
                self.last_tick = time.monotonic()
                self._heartbeat()
                for cmd in (self.control.poll_commands() if self.control else []):
                    if cmd == "drain":
                        self._start_draining()
                    else:
                        log.warning("unknown control command %r ignored", cmd)
                block = not self.has_work
                self._take_inbox(block)
                if self.has_work:
                    self.step()
                elif self.draining:
                    log.info("drained: no requests in flight")
                    if self.on_drained:
                        self.on_drained()
                    return
        except Exception:  # the main thread sees `stopped` without `draining` and exits 1
            log.exception("scheduler loop crashed")
        finally:
            self.stopped.set()

    def _take_inbox(self, block: bool) -> None:
        timeout = min(self.heartbeat_interval_s, 0.1) if block else 0
        try:
            item = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, obj = item
            if kind == "add":
                self.scheduler.add(obj)  # type: ignore[arg-type]
            elif kind == "abort":
                seq = self.scheduler.abort(obj)  # type: ignore[arg-type]
                if seq is not None:
                    seq.abort()
            elif kind == "drain":
                self._start_draining()
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining: %d running, %d waiting", len(self.scheduler.running), len(self.scheduler.waiting))
            if self.on_drain_begin:
                self.on_drain_begin()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.control and now - self._last_hb >= self.heartbeat_interval_s:
            self._last_hb = now
            self.control.send("heartbeat", **self.stats())

    def step(self) -> None:
        """One scheduler step: launch prefills for newly admitted sequences and one decode for the
        rest, then read the previous step's tokens and release the sequences that finished."""
        sched = self.scheduler
        launches: list[InFlight] = []
        new = sched.admit()
        for seq in new:
            logits = self.runner.prefill(seq.prompt_ids, seq.slot)
            launches.append(self._sample([seq], logits))
        admitted = {s.seq_id for s in new}
        batch = [s for s in sched.running if s.seq_id not in admitted and self._may_grow(s)]
        if batch:
            ids = self._input_ids(batch)  # first: it may read the unread tokens back
            lag = [int(s.seq_id in self._pending) for s in batch]
            logits = self.runner.decode(ids, [s.num_tokens - 1 + d for s, d in zip(batch, lag)],
                                        [s.slot for s in batch])
            launches.append(self._sample(batch, logits))
        self._read_back()
        self._inflight = launches
        self._pending = {s.seq_id: (i, row) for i, f in enumerate(launches) for row, s in enumerate(f.seqs)}
        self.served += len(sched.release_finished())
        self.steps += 1

    def _may_grow(self, seq: Sequence) -> bool:
        """Still running after its unread token, as far as the length limits tell."""
        n = int(seq.seq_id in self._pending)
        return (seq.finish_reason is None and len(seq.output_ids) + n < seq.params.max_tokens
                and seq.num_tokens + n < self.max_model_len)

    def _input_ids(self, batch: list[Sequence]) -> torch.Tensor:
        """Each sequence's last token: the unread one on the device where there is one."""
        if self._inflight and all(s.seq_id in self._pending for s in batch):
            tokens = torch.cat([f.tokens for f in self._inflight]) if len(self._inflight) > 1 else self._inflight[0].tokens
            offsets = [0]
            for f in self._inflight:
                offsets.append(offsets[-1] + len(f.seqs))
            rows = [offsets[i] + r for i, r in (self._pending[s.seq_id] for s in batch)]
            if rows == list(range(len(tokens))):  # steady state: the same batch, in order
                return tokens
            return tokens[to_device(rows, tokens.device)]
        self._read_back()  # a mix (not reached in steady state): read everything first
        return torch.tensor([s.last_token for s in batch], dtype=torch.long)

    def _read_back(self) -> None:
        """Apply the last step's tokens to their sequences (dropping those of finished ones)."""
        for launch in self._inflight:
            tokens = launch.wait()
            failed = launch.failed_rows()  # sampling errors fail their request, never the loop
            for row, (seq, tok) in enumerate(zip(launch.seqs, tokens)):
                if seq.finish_reason is None:
                    if row in failed:
                        seq.fail(failed[row])
                    else:
                        seq.append(tok)
        self._inflight, self._pending = [], {}

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> InFlight:
        tokens, finite, errors = guarded_sample(self.sampler, logits, [s.params for s in seqs],
                                                [s.generator for s in seqs])
        return InFlight.launch(seqs, tokens, finite, errors)
