"""One generated sequence: its tokens, KV blocks, stop conditions and text deltas for the client."""
from __future__ import annotations

import itertools
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

from .sampling import SamplingParams
from .tokenizer import CONTEXT, IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


def new_seq_id() -> int:
    """A sequence id no other sequence of this process has (given before its Sequence is made:
    engines/core/core_link.py maps a front-end key to it as the message arrives)."""
    return next(_ids)

# Released text a sequence keeps (past what a stop string needs): a long generation's text no longer
# grows, and is no longer copied whole for every token it appends.
TEXT_KEPT = 1024
# Replayed tokens a continuation decodes beyond its stop-string window: a character split across
# byte-level tokens and a leading space settle within a few tokens (the detokenizer's context is 4).
REPLAY_TAIL = 8


@dataclass
class Output:
    """What the client side receives after each step: new text, and the finish reason once done.

    `token_ids` are the ids generated since the previous Output, including those whose text is
    still held back: every Output is a consistent snapshot (all ids so far, the text released so
    far), which is what a continuation on another engine replays (`Sequence(replayed=...)`)."""

    seq_id: int
    delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "handoff" | None while running
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": why the request failed (the engine goes on)
    timing: tuple[float, float] | None = None  # first Output only: (queued, arrival -> this Output) seconds
    error_code: str | None = None  # with `error`: the OpenAI error code ("sampling_error", "parked")

    @property
    def is_scheduled(self) -> bool:
        """The scheduled marker (`Sequence.scheduled`): no text, no ids, not finished. The core
        emits no other Output like it (every sampled token is an Output, its text empty or not)."""
        return not self.delta and self.finish_reason is None and not self.token_ids

    def to_row(self) -> list:
        """The fields in order, for the core link (`Output(*row)` rebuilds it). Written out:
        `dataclasses.astuple` deep-copies every field and cost 9 µs an Output on the dev VM."""
        return [self.seq_id, self.delta, self.finish_reason, self.prompt_tokens, self.completion_tokens,
                self.token_ids, self.error, self.timing, self.error_code]


class Sequence:
    """A prompt plus its generated tokens. Text is held back while it may still become a stop string.

    A continued request (`replayed` > 0) ends its prompt with tokens another engine generated and
    reported: its text state (detokenizer, held-back text, stop-string window) is rebuilt from them
    as the other engine had it, and usage counts them as completion tokens, so what follows is
    what the other engine would have emitted."""

    def __init__(self, prompt_ids: list[int] | array, params: SamplingParams, tokenizer: Tokenizer,
                 eos_ids: set[int], max_model_len: int, emit: Callable[[Output], None], group: int | None = None,
                 replayed: int = 0, prefix_keys: bytes | None = None, seq_id: int | None = None):
        self.seq_id = new_seq_id() if seq_id is None else seq_id
        self.group = self.seq_id if group is None else group  # the request it belongs to (fair scheduling)
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.block_table: list[int] = []  # KV block of each block_size positions
        self.keyed = 0  # its first blocks that are keyed (full, their key known: engines/core/block_manager.py)
        self.last_key: bytes | None = None  # the key of the last of those (the next one's is hashed from it)
        self.prefix_keys = prefix_keys  # its prompt's keys as the front end hashed them (block_manager.prompt_keys)
        self.num_computed = 0  # positions whose keys and values are in the cache
        self.num_cached = 0  # of those, how many came from the prefix cache
        self.unread = 0  # sampled tokens still on their way from the device (0, 1, or 2 mid-step)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code: str | None = None
        self.emit = emit
        self.max_model_len = max_model_len
        self.replayed = replayed
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._detok, self._text = self._replay(tokenizer, prompt_ids, replayed)
        self._sent = max(0, len(self._text) - self._holdback)  # what the other engine had released
        self._unreported: list[int] = []
        self.arrived = time.monotonic()  # in the core (submit)
        self.first_scheduled: float | None = None  # the scheduler first gave it positions to compute
        self._timed = False

    def _replay(self, tokenizer: Tokenizer, ids: list[int] | array,
                replayed: int) -> tuple[IncrementalDetokenizer, str]:
        """The text state after the replayed tokens, as the other engine had it: only the released
        text's last `holdback` characters matter (stop strings are found in them), so only the
        tail is replayed, longer until it decodes to more than that (a continuation of 300 tokens
        took ~1.5 ms of the core's GIL this way when all 300 were replayed; 256 at a failover did
        that 256 times at once)."""
        tail = min(replayed, self._holdback + REPLAY_TAIL)
        while True:
            detok = IncrementalDetokenizer(tokenizer, ids[max(0, len(ids) - tail - CONTEXT):len(ids) - tail])
            text = "".join([detok.add(token) for token in ids[len(ids) - tail:]])
            if len(text) > self._holdback or tail == replayed:
                return detok, text
            tail = min(replayed, 2 * tail + 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def total_len(self) -> int:
        """Tokens including the one still being read back."""
        return self.num_tokens + self.unread

    @property
    def can_grow(self) -> bool:
        """Still running after its unread token, as far as the length limits tell."""
        n = len(self.output_ids) + self.unread
        return (self.finish_reason is None and n < self.params.max_tokens
                and self.total_len < self.max_model_len)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known token ids at positions start..end-1 (prompt, then output)."""
        p = len(self.prompt_ids)
        ids = self.prompt_ids[start:end] if start < p else []
        if not isinstance(ids, list):  # (a continuation's prompt: an int64 array, engines/core/core_link.py)
            ids = ids.tolist()
        return ids if end <= p else ids + self.output_ids[max(0, start - p):end - p]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def append(self, token: int) -> None:
        """Record a sampled token, apply every stop rule, and emit the text that is now final."""
        out, params = self.output_ids, self.params
        out.append(token)
        self._unreported.append(token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
        else:
            self._add_text(self._detok.add(token))
        if self.finish_reason is None and (len(out) >= params.max_tokens
                                           or len(self.prompt_ids) + len(out) >= self.max_model_len):
            self.finish_reason = "length"
        end = len(self._text) if self.finish_reason else max(self._sent, len(self._text) - self._holdback)
        delta, self._sent = self._text[self._sent:end], end
        if self._sent > TEXT_KEPT + self._holdback:  # released text matters only as stop-string context
            cut = self._sent - self._holdback
            self._text, self._sent = self._text[cut:], self._holdback
        self.emit(self.output(delta))  # (every token: its text may be held, empty, or a special token's)

    def _add_text(self, piece: str) -> None:
        """Take final text; a stop string found in it ends the sequence there."""
        if not piece:
            return
        start = max(0, len(self._text) - self._holdback)
        self._text += piece
        for s in self.params.stop:
            idx = self._text.find(s, start)
            if idx != -1:
                self._text = self._text[:idx]
                self.finish_reason = "stop"
                return

    def scheduled(self) -> None:
        """The scheduler gives it positions to compute for the first time: emit the scheduled
        marker (an Output with no text, no ids and no finish reason; `Output.is_scheduled`), which
        tells a stream's reader (the router) that this engine really ran the request, as opposed to
        only queueing it. Later steps (and a recompute after preemption) emit nothing more."""
        self.first_scheduled = time.monotonic()
        self.emit(Output(self.seq_id, "", None, len(self.prompt_ids) - self.replayed,
                         len(self.output_ids) + self.replayed))

    def fail(self, why: str, code: str = "sampling_error") -> None:
        """End this sequence with an error (e.g. its logits were not finite); others run on."""
        self.finish_reason, self.error, self.error_code = "error", why, code
        self.emit(self.output(""))

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.emit(self.output(""))

    def hand_off(self) -> None:
        """End here without finishing: this engine gave the KV pool up to another engine (a planned
        switchover), and the router continues the request there from the tokens sent so far."""
        self.finish_reason = "handoff"
        self.emit(self.output(""))

    def output(self, delta: str) -> Output:
        ids, self._unreported = self._unreported, []
        timing = None
        if not self._timed:
            self._timed = True
            queued = (self.first_scheduled or self.arrived) - self.arrived
            timing = (queued, time.monotonic() - self.arrived)
        return Output(self.seq_id, delta, self.finish_reason, len(self.prompt_ids) - self.replayed,
                      len(self.output_ids) + self.replayed, ids, self.error, timing,
                      self.error_code)
