"""The keys of KV blocks (engines/core/block_manager.py): a full block of `block_size` tokens is keyed by a
128-bit blake2b of its tokens and, through the previous block's key, of everything before them.
Stable across processes (not Python's `hash`): another engine, or the router, computes the same key.
numpy-free: the router imports this module."""
from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ROOT = bytes(16)  # the `prev` of a sequence's first block
# A deterministic engine's chains start elsewhere: its KV is computed by other kernels (other bits),
# so it never takes a block a default-mode engine left in the pool, nor gives it one. The version
# names the kernels' arithmetic: a release that changes it must change the version, so that a
# rollout's engines never continue from KV the old kernels wrote (other bits, under the same weights).
DETERMINISTIC_KERNELS = b"understudy: batch-invariant kernels v3 (K unsplit, attention splits merged in order)"
DETERMINISTIC_ROOT = hashlib.blake2b(DETERMINISTIC_KERNELS, digest_size=16).digest()

_KEY_HASH = hashlib.blake2b(digest_size=16)  # an empty one, copied for each key (chain_keys)


def key_root(deterministic: bool) -> bytes:
    """Where an engine's block keys chain from (the core's and its front end's alike)."""
    return DETERMINISTIC_ROOT if deterministic else ROOT


def _key(prev: bytes, data: bytes) -> bytes:
    h = _KEY_HASH.copy()  # (a copy: no constructor's arguments parsed)
    h.update(prev)
    h.update(data)
    return h.digest()


def block_key(prev: bytes | None, tokens: list[int]) -> bytes:
    """The key of a full block: its tokens and, through `prev`, everything before them."""
    return _key(prev or ROOT, _as_bytes(tokens))


def _as_bytes(tokens: "list[int] | array | np.ndarray") -> bytes:
    if isinstance(tokens, list):
        return array("q", tokens).tobytes()
    if isinstance(tokens, array):
        return tokens.tobytes()
    return tokens.astype("<i8", copy=False).tobytes()  # (an int64 array is hashed in place)


def chain_keys(prev: bytes, tokens: "list[int] | array | np.ndarray", block_size: int) -> list[bytes]:
    """The keys of the full blocks of `tokens` that follow a block keyed `prev`: `block_key` for
    each, hashed from one buffer (a continuation's 100 blocks at a failover, 256 at once)."""
    data, step, keys = _as_bytes(tokens), 8 * block_size, []
    for start in range(0, len(data) - step + 1, step):
        prev = _key(prev, data[start:start + step])
        keys.append(prev)
    return keys


def prompt_keys(prompt: "list[int] | np.ndarray", root: bytes, block_size: int) -> bytes:
    """The keys `match_prefix` looks up for `prompt` (its full blocks before the last token), joined:
    a continuation's front end hashes them beside the core (engines/frontend/engine_client.py), so that the
    scheduler thread of a new primary does not, for 256 continuations at once."""
    return b"".join(chain_keys(root, prompt[:(len(prompt) - 1) // block_size * block_size], block_size))


def checked_prompt_keys(given: bytes | None, prompt: "np.ndarray", root: bytes, block_size: int) -> bytes:
    """`prompt_keys(prompt)`, taking `given` (the router's, hashed as the stream went: KeyChain)
    when it is as long and its first key is this engine's (same root, same block size); else hashed."""
    n = (len(prompt) - 1) // block_size
    if given is not None and len(given) == 16 * n and (n == 0 or given[:16] == chain_keys(
            root, prompt[:block_size], block_size)[0]):
        return given
    return prompt_keys(prompt, root, block_size)


class KeyChain:
    """The keys of a growing sequence's full blocks, hashed as its tokens come: the router's, for a
    stream it may continue. A failover's batch then carries them, and the new primary's front end
    does not hash 256 prompts at once (~40% of its time a member, bench/RESULTS.md)."""

    def __init__(self, block_size: int, root: bytes = ROOT) -> None:
        self.block_size, self._prev = block_size, root
        self.keys = bytearray()  # 16 bytes a full block, in order
        self.hashed = 0  # tokens keyed (whole blocks)

    def catch_up(self, prompt: array, output: array) -> None:
        """Key the full blocks of `prompt + output` not keyed yet (cheap when there is none)."""
        start, bs, p = self.hashed, self.block_size, len(prompt)
        end = (p + len(output)) // bs * bs
        if end - start < bs:
            return
        if end <= p:
            tokens = prompt[start:end]
        elif start >= p:
            tokens = output[start - p:end - p]
        else:
            tokens = prompt[start:] + output[:end - p]
        keys = chain_keys(self._prev, tokens, bs)
        self.keys += b"".join(keys)
        self._prev, self.hashed = keys[-1], end

    def prompt(self, num_tokens: int) -> bytes:
        """`prompt_keys` of the sequence's first `num_tokens` tokens (their blocks keyed already)."""
        return bytes(self.keys[:16 * ((num_tokens - 1) // self.block_size)])
