"""One safetensors file's header (8 bytes of length, then JSON), read and checked without torch: the
daemon's loader places bytes by it (daemon/safetensors_index.py), the preflight checks tensors by it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from models.errors import CheckpointError

MAX_HEADER = 100 << 20


def raw_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(the header's tensor entries, the byte where data begins, the file's size); errors name the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file is {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file does not exist") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(e)[:60]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + n, size


def tensor_entries(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """Every tensor of a checkpoint folder: name -> (safetensors dtype, shape, file)."""
    out: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for key, info in raw_header(path)[0].items():
            try:
                out[key] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]), path)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {key}: malformed header entry {str(info)[:80]}") from None
    return out
