"""ModelArgs: the parts of an HF `config.json` the built-in decoder needs, validated."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import CheckpointError, UnknownArchError

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class RopeScaling(BaseModel):
    """`rope_scaling`: none, linear, or llama3 frequency scaling."""

    model_config = ConfigDict(extra="ignore")
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArgs(BaseModel):
    """One Llama-family decoder; Qwen2 and Mistral differ only by these switches."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant_method: str | None = None
    quant_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelArgs":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling and self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling.rope_type {self.rope_scaling.rope_type!r} is not supported "
                             "(expected default, linear or llama3)")
        return self


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """Map an HF config dict (old or new key names) onto ModelArgs fields."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHS:
        raise UnknownArchError(f"architectures[0] is {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    out = dict(raw)
    out["arch"] = arch
    out.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    if raw.get("head_dim") is None and raw.get("num_attention_heads"):
        out["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    out["rope_scaling"] = scaling
    if "rope_theta" not in raw and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["qkv_bias"] = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    out["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    eos = raw.get("eos_token_id")
    out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    quant = raw.get("quantization_config")
    if quant:
        out["quant_method"] = quant.get("quant_method", "unknown")
        out["quant_config"] = quant
    return out


def read_model_args(model_dir: str | Path) -> ModelArgs:
    """Read and validate `model_dir/config.json`; errors name the file and the field."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: checkpoint folder does not exist")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an HF checkpoint folder needs config.json)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    try:
        return ModelArgs.model_validate(_normalise(raw))
    except UnknownArchError as exc:
        raise UnknownArchError(f"{path}: {exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        raise CheckpointError(f"{path}: {where}: {err['msg']}") from None


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tp_problem(args: ModelArgs, tp_size: int) -> str | None:
    """Why this model has no rank shapes at `tp_size` ranks (what building it would raise:
    llama.py's KV heads, parallel.py's sharded dimensions), or None; no torch needed (the
    supervisor's preflight)."""
    for name in ("num_key_value_heads", "intermediate_size", "vocab_size"):  # (the heads follow the KV heads)
        if getattr(args, name) % tp_size:
            return f"{name} {getattr(args, name)} is not divisible by tp_size {tp_size}"
    return None


def kv_bytes_per_block(args: ModelArgs, tp_size: int, block_size: int, dtype: str) -> int:
    """Bytes of one KV block on one rank (every layer's keys and values), as CausalLM.kv_bytes_per_block."""
    return args.num_hidden_layers * 2 * (args.num_key_value_heads // tp_size) * block_size * args.head_dim \
        * DTYPE_BYTES[dtype]
