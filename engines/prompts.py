"""Request prompts to token ids, within the request limits and without stalling the scheduler.

Long texts are tokenized in a worker thread through ``Tokenizer.encode_batch``, whose Rust side
releases the GIL: the event loop keeps serving and the scheduler thread keeps stepping and sending
heartbeats while a large prompt is tokenized. Short texts are tokenized inline (a thread hop
costs more than they do).
"""
from __future__ import annotations

import asyncio

from .limits import RequestLimits, check_chars, check_shape, check_tokens, prompt_token_limit
from .tokenizer import Tokenizer

INLINE_CHARS = 8192  # texts up to this many characters in total are tokenized on the loop


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
            ids = await asyncio.to_thread(tokenizer.encode_batch, prompts)
    else:
        ids = [list(p) for p in prompts]
    if limits.max_prompt_tokens is not None:  # else the context check names the problem (server._params)
        for p in ids:
            check_tokens(len(p), limit, "prompt")
    return ids


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
