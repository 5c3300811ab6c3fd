"""Tokenizer: `tokenizer.json` through `tokenizers`, chat template from `tokenizer_config.json`.

BOS/EOS follow the checkpoint: `add_bos_token` in tokenizer_config.json (or the tokenizer's own
post-processor when the flag is absent), EOS ids from tokenizer_config.json plus
generation_config.json / config.json `eos_token_id` (an int or a list).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or malformed."""


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (bad roles, template raised)."""


def _token_text(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON ({e})") from e


class Tokenizer:
    """Encode/decode and chat templating for one checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerError(f"{tok_file}: missing (the engine needs a tokenizers-format tokenizer.json)")
        self.tok = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        # add_bos_token absent: the tokenizer.json post-processor decides (Llama 3 style).
        self.add_bos_token: bool | None = cfg.get("add_bos_token")
        self.eos_token_ids: set[int] = set()
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.tok.token_to_id(self.eos_token))
        for src in (gen, model_cfg):
            eos = src.get("eos_token_id")
            if isinstance(eos, int):
                self.eos_token_ids.add(eos)
            elif isinstance(eos, list):
                self.eos_token_ids.update(int(e) for e in eos)
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._alone: dict[int, str] = {}  # decode_alone's texts

        # the longest text one token spells: a prompt of more than limit * this characters has
        # more than `limit` tokens, whatever the tokenizer makes of it (wire/limits.py)
        self.max_token_chars = max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended as the checkpoint says (never twice).
        Holds the GIL for the whole encode: for long texts use ``encode_batch`` off the loop."""
        return self._fix_bos(text, self.tok.encode(text, add_special_tokens=add_special_tokens).ids,
                             add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text. The Rust side releases the GIL here (measured: a 20 MB prompt
        stalled another Python thread 0.5-1.1 s through ``encode``, 0.02-0.19 s through this), so
        a thread calling it leaves the scheduler loop and its heartbeats running."""
        encs = self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [self._fix_bos(t, e.ids, add_special_tokens) for t, e in zip(texts, encs)]

    def _fix_bos(self, text: str, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.bos_token_id is not None:
            has_bos = bool(ids) and ids[0] == self.bos_token_id
            if self.add_bos_token and not has_bos:
                ids = [self.bos_token_id] + ids
            elif self.add_bos_token is False and has_bos and not text.startswith(self.bos_token or "\0"):
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_alone(self, token_id: int) -> str:
        """`decode([token_id])`, remembered (at most one entry per token of the vocabulary)."""
        text = self._alone.get(token_id)
        if text is None:
            text = self._alone[token_id] = self.tok.decode([token_id], skip_special_tokens=True)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's chat template; the result already holds BOS if the template adds it."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat_template in tokenizer_config.json; use /v1/completions")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template bug or a message shape it cannot handle
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Template then encode without adding BOS again (the template owns special tokens)."""
        return self.tok.encode(self.apply_chat_template(messages), add_special_tokens=False).ids

    def encode_chat_batch(self, messages: list[dict]) -> list[int]:
        """``encode_chat`` with the GIL released while encoding (see ``encode_batch``)."""
        return self.encode_batch([self.apply_chat_template(messages)], add_special_tokens=False)[0]


def _raise_template_error(msg: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {msg}")


_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")  # what it reads
_preloaded: dict[Path, tuple[tuple, Tokenizer]] = {}


def _stamp(model_dir: Path) -> tuple:
    """(size, mtime) of each file a Tokenizer reads: a changed file is another tokenizer."""
    stamp = []
    for name in _FILES:
        try:
            st = (model_dir / name).stat()
            stamp.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            stamp.append((name, None, None))
    return tuple(stamp)


def preload(model_dir: str | Path) -> None:
    """Read the checkpoint's tokenizer now: the spawn server does, so that every engine it forks
    finds it in `load` (~0.1 s of a restart) instead of reading it again."""
    path = Path(model_dir).resolve()
    stamp = _stamp(path)
    _preloaded[path] = (stamp, Tokenizer(path))


def load(model_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer: the preloaded one while its files are unchanged, else read now."""
    path = Path(model_dir).resolve()
    hit = _preloaded.get(path)
    return hit[1] if hit is not None and hit[0] == _stamp(path) else Tokenizer(model_dir)


CONTEXT = 4  # ids before the first new one that an IncrementalDetokenizer decodes with it


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas without re-decoding everything.

    Keeps a short window (prefix_offset..read_offset) so that a multi-byte character split across
    tokens is emitted only when complete: a trailing U+FFFD means "wait for more". Only that last
    character waits: the text before it is final (invalid bytes decode to U+FFFD whatever follows),
    so a run of bytes that never forms a character (a looping model's) streams as it comes instead
    of holding the stream's text back until it ends.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail[-CONTEXT:])  # so that leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.released = 0  # characters of the window beyond its prefix already returned (bytes still arriving)

    def add(self, token_id: int) -> str:
        """Append one id; return the newly final text (may be empty)."""
        self.ids.append(token_id)
        tok, start, read = self.tokenizer, self.prefix_offset, self.read_offset
        # The window before the new id is one token most of the time (the last one emitted).
        prefix = tok.decode_alone(self.ids[start]) if read - start == 1 else tok.decode(self.ids[start:read])
        full = tok.decode(self.ids[start:])
        if full.endswith("\ufffd"):  # its last character may be incomplete: the text before it is final
            delta = full[len(prefix) + self.released:-1]
            self.released += len(delta)
            return delta
        if len(full) > len(prefix):
            delta = full[len(prefix) + self.released:]
            self.prefix_offset, self.read_offset, self.released = self.read_offset, len(self.ids), 0
            return delta
        return ""
