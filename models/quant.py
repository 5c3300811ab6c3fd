"""Which quantized checkpoints the built-in engine computes, read from `quantization_config`.

FP8 (float8_e4m3fn weights) in the two layouts in common use, and nothing else:
- block-wise: `weight_block_size` [bn, bk], a float32 `weight_scale_inv` per bn x bk block of the
  weight (a multiplier, despite its name), activations quantized per token and per group of bk at
  run time (DeepSeek-V3, Qwen3-FP8: `quant_method: fp8`; compressed-tensors' `block` strategy names
  the same scale `weight_scale`);
- per-tensor or per-channel: `weight_scale` (one value, or one per output row), activations quantized
  per token at run time (`dynamic`) or with the checkpoint's `input_scale` (`static`), or not at all
  (compressed-tensors weight-only FP8: the weight is dequantized).
Any other method or scheme is a CheckpointError naming it: never loaded as if unquantized.
No torch here: the supervisor's preflight reads it.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .errors import CheckpointError

PROCESSING_VERSION = "fp8-rows-v1"  # the daemon's post-load processing (models/fp8.py); in the fingerprint
SUPPORTED = "fp8 (block-wise or per-tensor/per-channel), compressed-tensors FP8"


class Fp8Scheme(BaseModel):
    """How one checkpoint's FP8 linears are laid out and computed."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["block", "rows"]  # rows: a scale per tensor or per output row, kept per row
    block: tuple[int, int] | None = None  # [bn, bk] of a block-wise weight scale
    activations: Literal["dynamic", "static", "none"] = "dynamic"  # none: weight-only (dequantized)
    scale_name: str = "weight_scale_inv"  # the checkpoint's key suffix of a weight's scale
    ignored: tuple[str, ...] = ()  # modules kept unquantized (names, or "re:" patterns)

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) is FP8."""
        for pat in self.ignored:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module):
                    return False
            elif module == pat or module.startswith(pat + ".") or module.endswith("." + pat):
                return False
        return True


def _fail(msg: str) -> None:
    raise CheckpointError(f"quantization_config: {msg}")


def _size_pair(v: Any, key: str) -> tuple[int, int]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                         for x in v)):
        _fail(f"{key}: expected two positive integers [rows, columns], got {v!r}")
    return v[0], v[1]


def parse_quant(qc: dict[str, Any] | None) -> Fp8Scheme | None:
    """The scheme of a parsed `quantization_config`, None when unquantized; CheckpointError naming
    what is not supported."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    _fail(f"quant_method {method!r} is not supported (supported: {SUPPORTED}); this engine would compute "
          "it wrongly, so it does not load it")


def _hf_fp8(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        _fail(f"fmt {fmt!r} is not supported (expected e4m3)")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        _fail(f"activation_scheme {act!r} is not supported (expected dynamic or static)")
    ignored = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(kind="rows", activations=act, scale_name="weight_scale", ignored=ignored)
    if act != "dynamic":
        _fail("activation_scheme 'static' with weight_block_size is not supported (block-wise FP8 quantizes "
              "activations per token group at run time)")
    return Fp8Scheme(kind="block", block=_size_pair(block, "weight_block_size"), ignored=ignored)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("kv_cache_scheme"):
        _fail("compressed-tensors kv_cache_scheme (an FP8 KV cache) is not supported")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        _fail(f"compressed-tensors with {len(groups) if isinstance(groups, dict) else '?'} config_groups is not "
              "supported (expected one FP8 group)")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    if not (w.get("type") == "float" and w.get("num_bits") == 8):
        _fail(f"compressed-tensors config_groups.{name}.weights {w.get('type')!r} of {w.get('num_bits')!r} bits is "
              f"not supported (supported: {SUPPORTED})")
    if w.get("dynamic") or w.get("symmetric") is False:
        _fail(f"compressed-tensors config_groups.{name}.weights: only static symmetric FP8 weights are supported")
    a = group.get("input_activations")
    ignored = tuple(qc.get("ignore") or ())
    strategy = w.get("strategy")
    if strategy == "block":
        if not a or a.get("dynamic") is not True or a.get("strategy") not in ("group", "token"):
            _fail(f"compressed-tensors config_groups.{name}: block-wise FP8 weights need dynamic activations")
        return Fp8Scheme(kind="block", block=_size_pair(w.get("block_structure"), "block_structure"),
                         scale_name="weight_scale", ignored=ignored)
    if strategy not in ("tensor", "channel"):
        _fail(f"compressed-tensors config_groups.{name}.weights.strategy {strategy!r} is not supported "
              "(expected tensor, channel or block)")
    if a is None:
        return Fp8Scheme(kind="rows", activations="none", scale_name="weight_scale", ignored=ignored)
    if not (a.get("type") == "float" and a.get("num_bits") == 8):
        _fail(f"compressed-tensors config_groups.{name}.input_activations must be FP8 or absent")
    if a.get("dynamic"):
        if a.get("strategy") not in ("token", "tensor"):
            _fail(f"compressed-tensors config_groups.{name}.input_activations.strategy {a.get('strategy')!r} "
                  "is not supported (expected token)")
        return Fp8Scheme(kind="rows", activations="dynamic", scale_name="weight_scale", ignored=ignored)
    if a.get("strategy") != "tensor":
        _fail(f"compressed-tensors config_groups.{name}: static activations need strategy 'tensor'")
    return Fp8Scheme(kind="rows", activations="static", scale_name="weight_scale", ignored=ignored)
