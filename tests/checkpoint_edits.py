"""A checkpoint folder copied with edits to its config.json and tensors (tests of bad checkpoints)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file


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
