"""One generated sequence: its tokens, KV slot, stop conditions and text deltas for the client."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


@dataclass
class Output:
    """What the client side receives after each step: new text, and the finish reason once done."""

    seq_id: int
    delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # with finish_reason "error": why the request failed (the engine goes on)


class Sequence:
    """A prompt plus its generated tokens. Text is held back while it may still become a stop string."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 eos_ids: set[int], max_model_len: int, emit: Callable[[Output], None]):
        self.seq_id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        self.emit = emit
        self.max_model_len = max_model_len
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._text = ""
        self._sent = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def append(self, token: int) -> None:
        """Record a sampled token, apply every stop rule, and emit the text that is now final."""
        self.output_ids.append(token)
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

    def fail(self, why: str) -> None:
        """End this sequence with an error (e.g. its logits were not finite); others run on."""
        self.finish_reason, self.error = "error", why
        self.emit(self.output(""))

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.emit(self.output(""))

    def output(self, delta: str) -> Output:
        return Output(self.seq_id, delta, self.finish_reason, len(self.prompt_ids), len(self.output_ids),
                      getattr(self, "error", None))
