"""Where each tensor's bytes are in a checkpoint folder's safetensors files.

The loader reads tensor bytes straight into their destination (the arena, or pinned staging
buffers), so it needs file offsets, which the `safetensors` Python API does not expose; the
format's header is 8 bytes of length plus JSON, parsed and checked here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models import CheckpointError
from models.checkpoint.header import raw_header, tensor_entries

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorLocation:
    """One tensor in one file: absolute byte range [start, end)."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse and check one safetensors header; errors name the file and tensor."""
    header, base, size = raw_header(path)
    out: dict[str, TensorLocation] = {}
    for key, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {key}: malformed header entry {str(info)[:80]}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{path}: tensor {key}: {end - begin} bytes cannot hold shape {shape} {info['dtype']}")
        if base + end > size:
            raise CheckpointError(f"{path}: truncated: tensor {key} ends at byte {base + end}, file has {size}")
        out[key] = TensorLocation(path, key, dtype, shape, base + begin, base + end)
    return out


def locate(model_dir: Path, keys: list[str]) -> dict[str, TensorLocation]:
    """Find every key in `model_dir` (through model.safetensors.index.json when present)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map object)") from None
        missing = [k for k in keys if k not in weight_map]
        if missing:
            raise CheckpointError(f"{index}: tensor {missing[0]} is missing from weight_map"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        files = sorted({weight_map[k] for k in keys})
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"model folder {model_dir} has no *.safetensors file")
    found: dict[str, TensorLocation] = {}
    for name in files:
        found.update(read_header(model_dir / name))
    missing = [k for k in keys if k not in found]
    if missing:
        where = model_dir / files[0] if len(files) == 1 else model_dir
        raise CheckpointError(f"{where}: tensor {missing[0]} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return {k: found[k] for k in keys}


def all_keys(model_dir: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> its file (the index's weight_map, else the headers)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map object)") from None
    return {key: file for key, (_, _, file) in tensor_entries(model_dir).items()}
