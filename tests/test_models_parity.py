"""Our decoder against transformers' reference implementation, on tiny random checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.models import Decode, Prefill, build_model, read_model_args

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


def greedy_with_cache(model, prompt: list[int], steps: int) -> list[int]:
    model.allocate_kv_cache(num_slots=2, max_len=64, device="cpu")
    ids = torch.tensor(prompt)
    logits = model(ids, torch.arange(len(prompt)), Prefill(slot=1))
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        pos = torch.tensor([len(prompt) + len(out) - 1])
        logits = model(torch.tensor(out[-1:]), pos, Decode(slot_ids=torch.tensor([1])))
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
    our_logits = ours(torch.tensor(prompt), torch.arange(len(prompt)), Prefill(slot=None), all_logits=True)
    assert (ref_logits - our_logits).abs().max().item() <= 1e-4
    with torch.no_grad():
        ref_out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_with_cache(ours, prompt, 12) == ref_out


def test_decode_batch_matches_single_sequences(tiny_model: Path) -> None:
    """Two sequences decoded together give the logits each gives alone."""
    model = load_ours(tiny_model)
    model.allocate_kv_cache(num_slots=4, max_len=32, device="cpu")
    prompts = {0: [1, 2, 3, 4, 5], 3: [9, 8, 7]}
    for slot, p in prompts.items():
        model(torch.tensor(p), torch.arange(len(p)), Prefill(slot=slot))
    batch = model(torch.tensor([10, 20]), torch.tensor([5, 3]), Decode(slot_ids=torch.tensor([0, 3])))
    for row, (slot, p) in enumerate(prompts.items()):
        alone = model(torch.tensor(p + [[10, 20][row]]), torch.arange(len(p) + 1), Prefill(slot=None))
        assert torch.allclose(batch[row], alone[0], atol=1e-5)
