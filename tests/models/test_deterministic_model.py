"""A deterministic model (models/invariant_forward.py) on the tiny checkpoint: the keys and
values a position writes and the logits it gets are bit-identical whether it is computed in one
prefill, in prefill chunks of several sizes, by decode steps, packed beside other sequences'
decode rows and chunks, or after a prefix-cache hit. bfloat16 is the hard case (CPU float32 is
nearly invariant already); on a GPU (marked `gpu`) the same checks run the Triton kernels."""
from __future__ import annotations

import pytest
import torch

from models import build_model, read_model_args
from models.paged import packed_meta
from daemon.loader import load_checkpoint_into

BS, NUM_BLOCKS, MAX_BLOCKS = 8, 96, 12
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def load(model_dir, dtype: torch.dtype, device: str, deterministic: bool = True):
    args = read_model_args(model_dir)
    model = build_model(args, dtype=dtype, device="meta")
    model.to_empty(device=device)
    load_checkpoint_into(model, model_dir)
    model.init_buffers()
    model.allocate_kv_cache(NUM_BLOCKS, BS, device)
    model.deterministic = deterministic
    return model


class Seq:
    """One sequence's tokens and blocks (distinct from every other Seq's, block 0 unused)."""

    def __init__(self, tokens: list[int], blocks: list[int]):
        self.tokens, self.blocks = tokens, blocks


def step(model, work: list[tuple[Seq, int, int]]) -> torch.Tensor:
    """Run positions start..start+n-1 of each (seq, start, n) as one packed step; logits of every row."""
    from models.kernels.paged_attention import query_block
    dev = model.kv_cache.device
    attn = model.model.layers[0].self_attn
    block_q = query_block(attn.heads, attn.kv_heads, max(n for _, _, n in work) == 1, model.deterministic)
    meta = packed_meta([(seq.blocks, start, n) for seq, start, n in work], BS, MAX_BLOCKS, block_q, dev)
    ids = [seq.tokens[p] for seq, start, n in work for p in range(start, start + n)]
    pos = [p for _, start, n in work for p in range(start, start + n)]
    return model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)


def kv_of(model, seq: Seq, length: int) -> torch.Tensor:
    """Every layer's keys and values of positions 0..length-1 of `seq`."""
    kv = model.kv_cache[:, :, seq.blocks]  # [layers, 2, blocks, BS, kvh, d]
    return kv.flatten(2, 3)[:, :, :length].clone()


def run_in_chunks(model, seq: Seq, chunks: list[int], others: list[Seq] | None = None) -> torch.Tensor:
    """Compute `seq` chunk by chunk (each chunk a step, beside one decode row or chunk of each of
    `others`, which advance as they go); returns the logits of every position of `seq`."""
    out, start, cursor = [], 0, {id(o): 0 for o in others or []}
    for i, n in enumerate(chunks):
        work = []
        for j, o in enumerate(others or []):
            m = 1 if (i + j) % 2 else 5  # others alternate decode rows and short chunks
            if cursor[id(o)] + m <= len(o.tokens):
                work.append((o, cursor[id(o)], m))
                cursor[id(o)] += m
        at = sum(w[2] for w in work[:len(work) // 2])
        work.insert(len(work) // 2, (seq, start, n))
        out.append(step(model, work)[at:at + n])
        start += n
    return torch.cat(out)


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 512, (60,), generator=g).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_and_logits_of_a_position_do_not_depend_on_how_it_was_computed(tiny_model, prompt, device, dtype):
    model = load(tiny_model, dtype, device)
    n = len(prompt)
    seq = Seq(prompt, list(range(1, 1 + -(-n // BS))))
    want = step(model, [(seq, 0, n)])
    want_kv = kv_of(model, seq, n)
    g = torch.Generator().manual_seed(12)
    others = [Seq(torch.randint(0, 512, (80,), generator=g).tolist(), list(range(20 + 11 * i, 31 + 11 * i)))
              for i in range(3)]
    plans = {"decode steps": [1] * n, "chunks of 7": [7] * 8 + [4], "chunks of 16": [16, 16, 16, 12],
             "ragged": [3, 29, 1, 1, 26]}
    for name, chunks in plans.items():
        for packed in (None, others):
            model.kv_cache.zero_()
            got = run_in_chunks(model, seq, chunks, packed)
            what = f"{name}{' beside other sequences' if packed else ''}"
            assert torch.equal(got, want), what
            assert torch.equal(kv_of(model, seq, n), want_kv), what


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_cache_hit_gives_the_uncached_bits(tiny_model, prompt, device):
    """B shares A's first 32 tokens (4 full blocks): computed on A's blocks (a hit, only its own
    tail computed), B's logits and KV equal B computed alone from scratch."""
    model = load(tiny_model, torch.bfloat16, device)
    tail = [(t * 7 + 3) % 512 for t in prompt[32:]]
    b_tokens = prompt[:32] + tail
    alone = Seq(b_tokens, list(range(1, 9)))
    want = step(model, [(alone, 0, len(b_tokens))])
    want_kv = kv_of(model, alone, len(b_tokens))
    model.kv_cache.zero_()
    a = Seq(prompt, list(range(1, 9)))
    step(model, [(a, 0, len(prompt))])  # A fills the shared prefix blocks 1..4
    hit = Seq(b_tokens, a.blocks[:4] + list(range(40, 44)))
    got = step(model, [(hit, 32, len(tail))])
    assert torch.equal(got, want[32:])
    assert torch.equal(kv_of(model, hit, len(b_tokens)), want_kv)


def test_the_default_mode_is_not_invariant_in_bf16_on_cpu(tiny_model, prompt):
    """What the deterministic mode fixes: the default path's decode steps differ from its prefill
    somewhere (if this starts to fail, the default path became invariant: good news, then the
    test above is the only one that matters)."""
    model = load(tiny_model, torch.bfloat16, "cpu", deterministic=False)
    seq = Seq(prompt, list(range(1, 9)))
    whole = step(model, [(seq, 0, len(prompt))])
    model.kv_cache.zero_()
    assert not torch.equal(run_in_chunks(model, seq, [1] * len(prompt)), whole)
