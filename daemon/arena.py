"""The arena: every tensor of one rank in ONE region, each at a 256-byte-aligned offset.

`layout(model)` plans the region from a model on meta (parameters and buffers, persistent or
not; tied tensors once, later names recorded as aliases). `build_views(region, manifest)` makes
all tensors over a region in one pass (one `view(dtype)` per dtype, one `as_strided` per tensor),
and `bind(model, views, manifest)` points the model's parameters and buffers at them.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from .fingerprint import LAYOUT_VERSION

ALIGN = 256
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class ArenaError(Exception):
    """An arena or manifest is inconsistent with itself or with the model; the message says where."""


class Manifest(BaseModel):
    """Where each tensor lives in the region, column by column (compact for 100k tensors)."""

    model_config = ConfigDict(extra="forbid")

    layout_version: int = LAYOUT_VERSION
    total_bytes: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    strides: list[list[int]]
    offsets: list[int]
    nbytes: list[int]
    kinds: list[Literal["param", "buffer"]]
    persistent: list[bool]
    aliases: dict[str, str] = {}  # tied name -> name it shares a tensor with

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        n = len(self.names)
        for col in ("dtypes", "shapes", "strides", "offsets", "nbytes", "kinds", "persistent"):
            if len(getattr(self, col)) != n:
                raise ValueError(f"manifest column {col} has {len(getattr(self, col))} entries, names has {n}")
        for name, dt, shape, off, nb in zip(self.names, self.dtypes, self.shapes, self.offsets, self.nbytes):
            if dt not in _DTYPES:
                raise ValueError(f"manifest: tensor {name} has unknown dtype {dt!r}")
            if off % ALIGN or off < 0 or off + nb > self.total_bytes:
                raise ValueError(f"manifest: tensor {name} at offset {off} (+{nb}) is unaligned or "
                                 f"outside the {self.total_bytes}-byte region")
            numel = 1
            for d in shape:
                numel *= d
            if numel * _DTYPES[dt].itemsize != nb:
                raise ValueError(f"manifest: tensor {name} of shape {shape} {dt} cannot be {nb} bytes")
        known = set(self.names)
        for alias, target in self.aliases.items():
            if target not in known:
                raise ValueError(f"manifest: alias {alias} points to unknown tensor {target}")
        return self

    def entries(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) for every name, aliases included."""
        out = {n: (d, tuple(s)) for n, d, s in zip(self.names, self.dtypes, self.shapes)}
        for alias, target in self.aliases.items():
            out[alias] = out[target]
        return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str, bool]]:
    """(name, tensor, kind, persistent) for every parameter and buffer, tied ones repeated."""
    out = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in module._parameters.items():
            if p is not None:
                out.append((prefix + pname, p, "param", True))
        for bname, b in module._buffers.items():
            if b is not None:
                out.append((prefix + bname, b, "buffer", bname not in module._non_persistent_buffers_set))
    return out


def layout(model: nn.Module) -> Manifest:
    """Plan the arena of `model` (on meta or anywhere): aligned offsets, tied tensors once."""
    names, dtypes, shapes, strides, offsets, nbytes, kinds, persistent = ([] for _ in range(8))
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    seen: set[str] = set()
    offset = 0
    for name, t, kind, pers in named_tensors(model):
        if name in seen:
            continue
        seen.add(name)
        if id(t) in first_name:
            aliases[name] = first_name[id(t)]
            continue
        if t.dtype not in _NAMES:
            raise ArenaError(f"tensor {name} has dtype {t.dtype}, which the arena does not support")
        first_name[id(t)] = name
        c = torch.empty(t.shape, dtype=t.dtype, device="meta")  # contiguous strides
        size = t.numel() * t.element_size()
        names.append(name)
        dtypes.append(_NAMES[t.dtype])
        shapes.append(list(t.shape))
        strides.append(list(c.stride()))
        offsets.append(offset)
        nbytes.append(size)
        kinds.append(kind)
        persistent.append(pers)
        offset += _align(max(size, 1))
    return Manifest(total_bytes=max(offset, ALIGN), names=names, dtypes=dtypes, shapes=shapes,
                    strides=strides, offsets=offsets, nbytes=nbytes, kinds=kinds,
                    persistent=persistent, aliases=aliases)


def build_views(region: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """All tensors of `manifest` over `region` (a flat uint8 tensor), aliases included, no copy."""
    if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() < manifest.total_bytes:
        raise ArenaError(f"region of {region.numel()} {region.dtype} elements cannot hold a "
                         f"{manifest.total_bytes}-byte arena")
    bases = {name: region.view(dt) for name, dt in _DTYPES.items() if name in set(manifest.dtypes)}
    sizes = {name: dt.itemsize for name, dt in _DTYPES.items()}
    views = {
        name: bases[dt].as_strided(shape, stride, off // sizes[dt])
        for name, dt, shape, stride, off in zip(manifest.names, manifest.dtypes, manifest.shapes,
                                                 manifest.strides, manifest.offsets)
    }
    for alias, target in manifest.aliases.items():
        views[alias] = views[target]
    return views


def bind(model: nn.Module, views: dict[str, torch.Tensor], manifest: Manifest) -> None:
    """Point every parameter and buffer of `model` at its view (Parameters without grad)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    params: dict[str, nn.Parameter] = {}
    kind_of = dict(zip(manifest.names, manifest.kinds))
    for alias, target in manifest.aliases.items():
        kind_of[alias] = kind_of[target]
    for name, view in views.items():
        mod_name, _, leaf = name.rpartition(".")
        module = modules.get(mod_name)
        if module is None:
            raise ArenaError(f"arena tensor {name}: the model has no module {mod_name!r}")
        if kind_of[name] == "param":
            if leaf not in module._parameters:
                raise ArenaError(f"arena tensor {name}: module {mod_name!r} has no parameter {leaf!r}")
            key = id(view)
            if key not in params:
                params[key] = nn.Parameter(view, requires_grad=False)
            module._parameters[leaf] = params[key]
        else:
            if leaf not in module._buffers:
                raise ArenaError(f"arena tensor {name}: module {mod_name!r} has no buffer {leaf!r}")
            module._buffers[leaf] = view


def check_materialised(model: nn.Module, expected: dict[str, tuple[str, tuple[int, ...]]],
                       device: torch.device) -> None:
    """Every parameter and buffer is on `device` with the expected dtype and shape; none on meta."""
    seen = set()
    for name, t, _, _ in named_tensors(model):
        seen.add(name)
        if name not in expected:
            raise ArenaError(f"model tensor {name} got no tensor from the arena")
        dt, shape = expected[name]
        if t.is_meta or t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            raise ArenaError(f"model tensor {name} is on {t.device}, expected {device}")
        if _NAMES.get(t.dtype) != dt or tuple(t.shape) != shape:
            raise ArenaError(f"model tensor {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dt}")
    missing = set(expected) - seen
    if missing:
        raise ArenaError(f"arena tensors not in the model: {', '.join(sorted(missing)[:5])}")
