"""One generated sequence: its tokens, KV slot, stop conditions and text deltas for the client."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


@dataclass
class Output:
    """What the client side receives after each step: new text, and the finish reason once done.

    `token_ids` are the ids generated since the previous Output, including those whose text is
    still held back: every Output is a consistent snapshot (all ids so far, the text released so
    far), which is what a continuation on another engine replays (`Sequence(replayed=...)`)."""

    seq_id: int
    delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)


class Sequence:
    """A prompt plus its generated tokens. Text is held back while it may still become a stop string.

    A continued request (`replayed` > 0) ends its prompt with tokens another engine generated and
    reported: its text state (detokenizer, held-back text, stop-string window) is rebuilt from them
    as the other engine had it, and usage counts them as completion tokens, so what follows is
    what the other engine would have emitted."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 eos_ids: set[int], max_model_len: int, emit: Callable[[Output], None], replayed: int = 0):
        self.seq_id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.emit = emit
        self.max_model_len = max_model_len
        self.replayed = replayed
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids[:len(prompt_ids) - replayed])
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._text = ""
        for token in prompt_ids[len(prompt_ids) - replayed:]:
            self._text += self._detok.add(token)
        self._sent = max(0, len(self._text) - self._holdback)  # what the other engine had released
        self._unreported: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def append(self, token: int) -> None:
        """Record a sampled token, apply every stop rule, and emit the text that is now final."""
        self.output_ids.append(token)
        self._unreported.append(token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
        else:
            start = max(0, len(self._text) - self._holdback)
            self._text += self._detok.add(token)
            for s in self.params.stop:
                idx = self._text.find(s, start)
                if idx != -1:
                    self._text = self._text[:idx]
                    self.finish_reason = "stop"
                    break
        if self.finish_reason is None and (len(self.output_ids) >= self.params.max_tokens
                                           or self.num_tokens >= self.max_model_len):
            self.finish_reason = "length"
        end = len(self._text) if self.finish_reason else max(self._sent, len(self._text) - self._holdback)
        delta, self._sent = self._text[self._sent:end], end
        if delta or self.finish_reason:
            self.emit(self.output(delta))

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.emit(self.output(""))

    def output(self, delta: str) -> Output:
        ids, self._unreported = self._unreported, []
        return Output(self.seq_id, delta, self.finish_reason, len(self.prompt_ids) - self.replayed,
                      len(self.output_ids) + self.replayed, ids)
