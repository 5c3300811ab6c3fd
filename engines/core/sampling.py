"""Sampling parameters of one sequence and the batched sampler (greedy, temperature, top-k, top-p).

A draw is a pure function of (seed, position): the token a sequence samples at position p depends
only on the logits, its sampling parameters, its seed and p. It does not depend on the batch, on
the steps before, or on the engine process, so another engine given the same prompt + tokens
(same seed) draws exactly what a dead one would have (DESIGN.md §3, request continuation).

How: the Gumbel-max trick. Each candidate token v gets noise -log(-log(u)) with u from an integer
hash of (seed, position, v); the token with the largest filtered-logit + noise is a draw from the
filtered softmax. The hash is int64 arithmetic on the logits' device (wrapping multiply, masked
shifts), so its bits are the same on CPU and CUDA; no torch.Generator, no per-row Python loop,
no host sync.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from .device_upload import to_device

_M64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """What the server validated; temperature 0 means greedy. `seed` is set by the engine at
    submit when the request gives none (`ensure_seed`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def wire(self) -> dict:
        """Its fields as JSON takes them (for the core link; `dataclasses.asdict` deep-copies)."""
        return dict(vars(self))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1


def ensure_seed(params: SamplingParams) -> SamplingParams:
    """Give `params` a random 63-bit seed if it has none (in place; returned for chaining)."""
    if params.seed is None:
        params.seed = secrets.randbits(63)
    return params


class Sampler:
    """Picks the next token for each row of a logits batch: greedy rows take argmax; the others
    are scaled by temperature, cut by top-k and top-p, and drawn with Gumbel noise hashed from
    (seed, position, token)."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """Token ids `[B]` on the logits' device; `positions[i]` is the position row i's token will
        occupy (the sequence's length before it). Nothing here waits for the device."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        out = logits.argmax(dim=-1)  # the dtype's values widen exactly: same argmax as float32
        if not rows:
            return out
        dev = logits.device
        sub = logits.float() if len(rows) == len(params) else logits.index_select(0, to_device(rows, dev)).float()
        temp = to_device([params[i].temperature for i in rows], dev, torch.float32).unsqueeze(1)
        filtered = filter_logits(sub / temp, [params[i] for i in rows])
        keys = [row_key(params[i].seed or 0, positions[i]) for i in rows]
        drawn = (filtered + gumbel_noise(to_device(keys, dev), filtered.shape[-1])).argmax(dim=-1)
        if len(rows) == len(params):
            return drawn
        return out.index_copy(0, to_device(rows, dev), drawn)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits with everything outside each row's top-k and top-p nucleus set to -inf."""
    vocab = logits.shape[-1]
    if all(p.top_p >= 1.0 and not 0 < p.top_k < vocab for p in params):
        return logits
    if logits.shape[0] == 1:  # CUDA scans a lone row with another algorithm (cub): keep one row's sums
        return filter_logits(logits.repeat(2, 1), params * 2)[:1]  # batch-invariant
    ks = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], logits.device)
    ps = to_device([p.top_p for p in params], logits.device, logits.dtype)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the top token always stays).
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(before >= ps.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


# ---- the hash ---------------------------------------------------------------------------------
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (the host half of the hash)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """A 64-bit key for (seed, position), as a signed int64 value."""
    return _signed(_mix_int(_mix_int(seed) + (position + 1) * _GOLDEN))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor (multiplication wraps modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _signed(_C1)
    x = (x ^ _shr(x, 27)) * _signed(_C2)
    return x ^ _shr(x, 31)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` float32 Gumbel(0, 1) noise; row b, column v is a function of (keys[b], v) only."""
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64) * _signed(_GOLDEN)
    bits = _shr(_mix(keys.unsqueeze(1) + cols.unsqueeze(0)), 40)  # top 24 bits
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))
