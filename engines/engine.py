"""LLMEngine: the scheduler loop on rank 0 (its own thread): admit, prefill, batched decode, sample.

Requests and aborts arrive through a thread-safe inbox and join or leave between steps. The loop
also sends heartbeats and polls control commands, so a stuck loop goes silent to the supervisor.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from .control import ControlChannel
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams, make_generator
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
        seqs = []
        for ids in prompts:
            seq = Sequence(ids, params, self.tokenizer, self.eos_ids, self.max_model_len, lambda o: None)
            if not params.greedy:
                seq.generator = make_generator(params.seed, self._device)
            self.scheduler.add(seq)
            seqs.append(seq)
        while self.scheduler.has_work:
            self.step()
        return [s.output_ids for s in seqs]

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self.last_tick = time.monotonic()
                self._heartbeat()
                for cmd in (self.control.poll_commands() if self.control else []):
                    if cmd == "drain":
                        self._start_draining()
                    else:
                        log.warning("unknown control command %r ignored", cmd)
                block = not self.scheduler.has_work
                self._take_inbox(block)
                if self.scheduler.has_work:
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
        """One scheduler step: prefill newly admitted sequences, then one decode for the rest."""
        sched = self.scheduler
        new = sched.admit()
        for seq in new:
            logits = self.runner.prefill(seq.prompt_ids, seq.slot)
            self._sample([seq], logits)
        batch = [s for s in sched.running if s.finish_reason is None and s not in new]
        if batch:
            logits = self.runner.decode([s.last_token for s in batch], [s.num_tokens - 1 for s in batch],
                                        [s.slot for s in batch])
            self._sample(batch, logits)
        self.served += len(sched.release_finished())
        self.steps += 1

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq, tok in zip(seqs, tokens):
            seq.append(tok)
