"""Our decoder against transformers' reference implementation, on tiny random checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import build_model, read_model_args
from models.paged import sequence_meta

transformers = pytest.importorskip("transformers")


def load_ours(model_dir: Path):
    """tp=1, float32, CPU: materialise and copy the checkpoint tensors in (test-only loader)."""
    model = build_model(read_model_args(model_dir), device="meta").to_empty(device="cpu")
    params = dict(model.named_parameters())
    targets = model.checkpoint_targets()
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        spec = targets[name]
        params[spec.param].data.narrow(0, spec.dst_offset, tensor.shape[0]).copy_(tensor)
    model.init_buffers()
    return model


BLOCK = 4
TABLE = [3, 1, 6, 2, 5, 4, 7]  # out of order on purpose: only the block table says where a position lives


def prefill(model, prompt: list[int], table: list[int] = TABLE) -> torch.Tensor:
    """Every position's logits for a prompt written into `table`'s blocks."""
    return model(torch.tensor(prompt), torch.arange(len(prompt)), sequence_meta(table, 0, len(prompt), BLOCK, "cpu"))


def greedy_with_cache(model, prompt: list[int], steps: int) -> list[int]:
    model.allocate_kv_cache(num_blocks=8, block_size=BLOCK, device="cpu")
    out = [int(prefill(model, prompt)[-1].argmax())]
    for _ in range(steps - 1):
        n = len(prompt) + len(out) - 1
        logits = model(torch.tensor(out[-1:]), torch.tensor([n]), sequence_meta(TABLE, n, 1, BLOCK, "cpu"))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_and_greedy_match_transformers(make_tiny, arch: str) -> None:
    model_dir = make_tiny(arch=arch, seed=7)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_ours(model_dir)
    prompt = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    ours.allocate_kv_cache(num_blocks=8, block_size=BLOCK, device="cpu")
    our_logits = prefill(ours, prompt)
    assert (ref_logits - our_logits).abs().max().item() <= 1e-4
    with torch.no_grad():
        ref_out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_with_cache(ours, prompt, 12) == ref_out


def test_packed_step_matches_single_sequences(tiny_model: Path) -> None:
    """Two decode rows and a prefill chunk in one packed step give the logits each gives alone."""
    model = load_ours(tiny_model)
    model.allocate_kv_cache(num_blocks=16, block_size=BLOCK, device="cpu")
    prompts = {(1, 2): [1, 2, 3, 4, 5], (9, 4, 3): [9, 8, 7], (5, 6, 11, 12): [4, 4, 3, 2, 1, 7, 7, 9, 6]}
    for table, p in list(prompts.items())[:2]:
        prefill(model, p, list(table))
    # decode rows for the first two, then positions 4.. of the third (its first 4 written first)
    third_table, third = list(prompts.items())[2]
    prefill(model, third[:4], list(third_table))
    tables = torch.zeros(3, 4, dtype=torch.long)
    for i, t in enumerate(prompts):
        tables[i, :len(t)] = torch.tensor(t)
    ids = torch.tensor([10, 20] + third[4:])
    pos = torch.tensor([5, 3] + list(range(4, 9)))
    rows = torch.tensor([tables[i, p // BLOCK] * BLOCK + p % BLOCK for i, p in zip([0, 1] + [2] * 5, pos.tolist())])
    from models import AttnMeta
    meta = AttnMeta(slot_mapping=rows, cu_q=torch.tensor([0, 1, 2, 7]), seq_lens=torch.tensor([6, 4, 9]),
                    block_tables=tables, max_q_len=5, logit_rows=torch.tensor([0, 1, 6]))
    batch = model(ids, pos, meta)
    alone = [p + [extra] for p, extra in zip(list(prompts.values())[:2], [10, 20])] + [third]
    model.allocate_kv_cache(num_blocks=16, block_size=BLOCK, device="cpu")
    for row, p in enumerate(alone):
        assert torch.allclose(batch[row], prefill(model, p)[-1], atol=1e-5)
