"""Tiny checkpoints in tests: one loaded as the engine loads it (the daemon's loader), its logits on a
prompt, and a copy with edits to its config.json and tensors (tests of bad checkpoints)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from daemon.loader import load_checkpoint_into
from models import build_model, read_model_args
from models.paged import sequence_meta

PROMPTS = [[5, 6, 7, 8, 9, 10], [1, 300, 22, 47, 3, 3, 9, 120, 64], [200, 11]]


def load(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):  # noqa: ANN201 (CausalLM)
    """The checkpoint through the loader (its processing and checks), with a KV cache of 8 blocks of 16."""
    model = build_model(read_model_args(model_dir), dtype=dtype, device="meta").to_empty(device=device)
    load_checkpoint_into(model, model_dir)
    model.allocate_kv_cache(8, 16, device)
    return model


def logits(model, prompt: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Every position's logits of `prompt`, prefilled from position 0 into block 1."""
    n = len(prompt)
    return model(torch.tensor(prompt), torch.arange(n), sequence_meta([1], 0, n, 16, "cpu"))


def edited_copy(src: Path, dst: Path, config: Callable[[dict], object] | None = None,
                tensors: Callable[[dict], object] | None = None) -> Path:
    """`src` copied to `dst`, config.json's dict and the tensors' dict passed through the edits."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    if tensors:
        tensors(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst
