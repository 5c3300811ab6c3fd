"""Request prompts to token ids, within the request limits and without stalling the scheduler.

Long texts are tokenized in a worker thread through ``Tokenizer.encode_batch``, whose Rust side
releases the GIL: the event loop keeps serving and the scheduler thread keeps stepping and sending
heartbeats while a large prompt is tokenized. Short texts are tokenized inline (a thread hop
costs more than they do).
"""
from __future__ import annotations

import asyncio

from wire.limits import LimitError, RequestLimits, check_chars, check_shape, check_tokens, prompt_token_limit
from engines.core.tokenizer import Tokenizer

INLINE_CHARS = 8192  # texts up to this many characters in total are tokenized on the loop
CHUNK_CHARS = 1 << 20  # prompts go to the tokenizer thread in chunks of about this many characters:
                       # a request whose first prompt cannot fit fails before the rest is tokenized


async def completion_prompt_ids(tokenizer: Tokenizer, prompt, n: int, limits: RequestLimits,
                                max_model_len: int) -> list[list[int]]:
    """The four OpenAI prompt shapes as token id lists, each within limits.max_prompt_tokens."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    check_shape(limits, len(prompts), n)
    limit = prompt_token_limit(limits, max_model_len)
    if isinstance(prompts[0], str):
        for p in prompts:
            check_chars(len(p), limit, tokenizer.max_token_chars, "prompt")
        if sum(len(p) for p in prompts) <= INLINE_CHARS:
            ids = [tokenizer.encode(p) for p in prompts]
        else:
            ids = []
            for chunk in _chunks(prompts):
                ids += await asyncio.to_thread(tokenizer.encode_batch, chunk)
                _check_context(ids[-len(chunk):], max_model_len)
    else:
        ids = [list(p) for p in prompts]
    if limits.max_prompt_tokens is not None:  # else the context check names the problem (server._params)
        for p in ids:
            check_tokens(len(p), limit, "prompt")
    return ids


def _chunks(prompts: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for p in prompts:
        if out[-1] and size + len(p) > CHUNK_CHARS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += len(p)
    return out


def _check_context(ids: list[list[int]], max_model_len: int) -> None:
    """The context check of server._params, early: the rest of the request is not tokenized."""
    for p in ids:
        if len(p) >= max_model_len:
            raise LimitError(400, f"the prompt is {len(p)} tokens; this model's context is {max_model_len} tokens, "
                                  f"leaving no room to generate", "prompt", "context_length_exceeded")


async def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], n: int, limits: RequestLimits,
                          max_model_len: int) -> list[int]:
    """The chat template applied and tokenized, within limits.max_prompt_tokens."""
    check_shape(limits, 1, n, "messages")
    limit = prompt_token_limit(limits, max_model_len)
    chars = sum(len(m["content"]) for m in messages)
    check_chars(chars, limit, tokenizer.max_token_chars, "messages")
    if chars <= INLINE_CHARS:
        ids = tokenizer.encode_chat(messages)
    else:
        ids = await asyncio.to_thread(tokenizer.encode_chat_batch, messages)
    if limits.max_prompt_tokens is not None:
        check_tokens(len(ids), limit, "messages")
    return ids
