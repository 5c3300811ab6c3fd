"""ModelArgs: the parts of an HF `config.json` the built-in decoder needs, validated.

A hostile or broken config.json is a CheckpointError naming the file and the key
(``<dir>/config.json: hidden_size: expected an integer >= 1, got 'abc'``), never a traceback: the
engine exits with its boot-error code and ``serve --check`` prints the line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import CheckpointError, UnknownArchError
from .quant import Fp8Scheme, parse_quant

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3MoeForCausalLM",
                   "MixtralForCausalLM")
MOE_ARCHS = {"Qwen3MoeForCausalLM": "mlp", "MixtralForCausalLM": "block_sparse_moe"}  # -> the layer's MoE module

PositiveInt = Annotated[int, Field(ge=1, strict=True)]
"""A size, count or length: a JSON integer >= 1 (strict: not "64", 64.5 or true)."""
PositiveFloat = Annotated[float, Field(gt=0)]


class RopeScaling(BaseModel):
    """`rope_scaling`: none, linear, or llama3 frequency scaling."""

    model_config = ConfigDict(extra="ignore")
    rope_type: str = "default"
    factor: PositiveFloat = 1.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


class ModelArgs(BaseModel):
    """One Llama-family decoder; Qwen2, Mistral and the Mixture-of-Experts decoders (Qwen3-MoE,
    Mixtral) differ only by these switches."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    arch: str
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: PositiveInt = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant_method: str | None = None
    quant_config: dict[str, Any] | None = None
    quant: Fp8Scheme | None = None  # what quant_config says, if the engine computes it (else a CheckpointError)
    qk_norm: bool = False  # Qwen3: RMSNorm of each head's query and key before the rotary
    num_experts: int = Field(default=0, ge=0, strict=True)  # 0: dense
    num_experts_per_tok: int = Field(default=0, ge=0, strict=True)
    moe_intermediate_size: PositiveInt | None = None  # an expert's FFN width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (Mixtral always does)
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def beyond_plain(self) -> str | None:
        """What this model has that the plain-layer paths (the fused batch-1 kernels, deterministic
        mode's batch-invariant forward) do not compute, or None."""
        if self.quant is not None:
            return "FP8 weights"
        if self.is_moe:
            return "Mixture-of-Experts layers"
        if self.qk_norm:
            return "query and key norms"
        return None

    def moe_layer(self, i: int) -> bool:
        """Whether decoder layer i holds experts (else a dense MLP of intermediate_size)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelArgs":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: expected a divisor of num_attention_heads "
                             f"({self.num_attention_heads}), got {self.num_key_value_heads}")
        if self.rope_scaling and self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling.rope_type: {self.rope_scaling.rope_type!r} is not supported "
                             "(expected default, linear or llama3)")
        if (self.rope_scaling and self.rope_scaling.rope_type == "llama3"
                and self.rope_scaling.high_freq_factor <= self.rope_scaling.low_freq_factor):
            raise ValueError(f"rope_scaling.high_freq_factor: expected a number > low_freq_factor "
                             f"({self.rope_scaling.low_freq_factor}), got {self.rope_scaling.high_freq_factor}")
        if self.arch in MOE_ARCHS:
            if self.num_experts < 1:
                raise ValueError(f"{_EXPERTS_KEY[self.arch]}: expected an integer >= 1 for {self.arch}, "
                                 f"got {self.num_experts}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok: expected 1..{self.num_experts} (the experts), "
                                 f"got {self.num_experts_per_tok}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"mlp_only_layers: layer {bad[0]} is outside 0..{self.num_hidden_layers - 1}")
        return self


# The config.json key a ModelArgs field was read from, where the names differ.
_SOURCE_KEY = {"arch": "architectures", "eos_token_ids": "eos_token_id", "qkv_bias": "attention_bias",
               "quant_method": "quantization_config.quant_method", "quant_config": "quantization_config"}
_EXPERTS_KEY = {"Qwen3MoeForCausalLM": "num_experts", "MixtralForCausalLM": "num_local_experts"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mapping(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``raw[key]``: a JSON object or absent/null (then None); anything else is a CheckpointError."""
    v = raw.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise CheckpointError(f"{key}: expected a JSON object, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """Map an HF config dict (old or new key names) onto ModelArgs fields. Values of the wrong type
    are left for ModelArgs to refuse, or refused here (CheckpointError) where they would be used."""
    archs = raw.get("architectures")
    if archs is not None and not isinstance(archs, list):
        raise CheckpointError(f"architectures: expected a list of class names, got {_show(archs)}")
    arch = archs[0] if archs else None
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise UnknownArchError(f"architectures[0] is {_show(arch)}; supported: {', '.join(SUPPORTED_ARCHS)}")
    out = dict(raw)
    out["arch"] = arch
    out.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if raw.get("head_dim") is None and _is_int(hidden) and _is_int(heads) and heads > 0:
        out["head_dim"] = hidden // heads  # (else ModelArgs names the bad hidden_size or num_attention_heads)
    rope = _mapping(raw, "rope_parameters") or {}
    scaling = _mapping(raw, "rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    out["rope_scaling"] = scaling or None
    if "rope_theta" not in raw and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    bias = raw.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise CheckpointError(f"attention_bias: expected true or false, got {_show(bias)}")
    out["qkv_bias"] = arch == "Qwen2ForCausalLM" or bias
    out["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    eos = raw.get("eos_token_id")
    if not (eos is None or _is_int(eos) or isinstance(eos, list)):
        raise CheckpointError(f"eos_token_id: expected a token id or a list of them, got {_show(eos)}")
    out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    quant = _mapping(raw, "quantization_config")
    if quant:
        out["quant_method"] = quant.get("quant_method", "unknown")
        out["quant_config"] = quant
        if isinstance(out["quant_method"], str):  # (else ModelArgs names the bad value)
            out["quant"] = parse_quant(quant)
    out.pop("num_experts", None)
    if arch in MOE_ARCHS:
        out["num_experts"] = raw.get(_EXPERTS_KEY[arch])
        out["qk_norm"] = arch == "Qwen3MoeForCausalLM"
        if arch == "MixtralForCausalLM":
            out["norm_topk_prob"], out["moe_intermediate_size"] = True, None
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            if raw.get(key) is None:
                out.pop(key, None)
    else:
        for key in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            out.pop(key, None)
    return out


def _describe(err: dict[str, Any]) -> str:
    """One pydantic error as ``key: expected X, got Y`` in config.json's own key names."""
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in _SOURCE_KEY:
        loc[0] = _SOURCE_KEY[loc[0]]
    where = ".".join(loc)
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return f"{where or 'config'}: required key is missing"
    if kind == "value_error":  # a model validator's "key: what"
        text = str(ctx.get("error", err["msg"]))
        return f"{where}: {text}" if where else text
    expected = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                "dict": "a JSON object", "model": "a JSON object", "tuple": "a list", "list": "a list"}
    base = kind.split("_")[0]
    if kind == "greater_than_equal":
        want = f"{'an integer' if _is_int(ctx.get('ge')) else 'a number'} >= {ctx.get('ge')}"
    elif kind == "greater_than":
        want = f"a number > {ctx.get('gt')}"
    elif base in expected:
        want = expected[base] + (" >= 1" if base == "int" and loc and loc[-1] in _POSITIVE else "")
    else:
        want = err["msg"]
    return f"{where or 'config'}: expected {want}, got {_show(err.get('input'))}"


_POSITIVE = {name for model in (ModelArgs, RopeScaling) for name, f in model.model_fields.items()
             if any(getattr(m, "ge", None) == 1 for m in f.metadata)}


def read_model_args(model_dir: str | Path) -> ModelArgs:
    """Read and validate `model_dir/config.json`; errors name the file and the field."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: checkpoint folder does not exist")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an HF checkpoint folder needs config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return ModelArgs.model_validate(_normalise(raw))
    except CheckpointError as exc:  # (UnknownArchError included: its type is kept)
        raise type(exc)(f"{path}: {exc}") from None
    except ValidationError as exc:
        raise CheckpointError(f"{path}: {_describe(exc.errors()[0])}") from None
    except (TypeError, KeyError, AttributeError, ValueError, ZeroDivisionError, IndexError) as exc:
        # A shape of config.json not foreseen above: still a boot error that names the file, never a traceback.
        raise CheckpointError(f"{path}: not a config this engine can read ({type(exc).__name__}: {exc})") from None


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def deterministic_refusal(beyond: str) -> str:
    """The one line a deterministic engine is refused with, for a model with `beyond` (ModelArgs.beyond_plain)."""
    return (f"engines.deterministic: not available for this checkpoint's {beyond}: the batch-invariant kernels "
            "cover plain bf16/fp32 Llama-family layers; set engines.deterministic: false")


def tp_problem(args: ModelArgs, tp_size: int) -> str | None:
    """Why this model has no rank shapes at `tp_size` ranks (what building it would raise:
    decoder.py's KV heads, parallel.py's sharded dimensions), or None; no torch needed (the
    supervisor's preflight)."""
    names = ["num_key_value_heads", "intermediate_size", "vocab_size"]  # (the heads follow the KV heads)
    if args.is_moe and args.moe_intermediate_size:
        names.append("moe_intermediate_size")
    for name in names:
        if getattr(args, name) % tp_size:
            return f"{name} {getattr(args, name)} is not divisible by tp_size {tp_size}"
    return None


def block_problem(args: ModelArgs, tp_size: int) -> str | None:
    """Why a block-wise FP8 checkpoint's blocks do not tile this rank's shards, or None: every
    sharded or fused dimension of a quantized weight a whole number of blocks."""
    bn, bk = args.quant.block
    d, h = args.head_dim, args.hidden_size
    rows = {"q_proj rows": args.num_attention_heads * d, "k_proj/v_proj rows": args.num_key_value_heads * d,
            "intermediate_size": args.intermediate_size}
    cols = {"o_proj columns": args.num_attention_heads * d, "down_proj columns": args.intermediate_size}
    if args.is_moe:
        rows["expert rows"] = cols["expert columns"] = args.expert_size
    if h % bk or h % bn:
        return f"hidden_size {h} is not a whole number of {bn}x{bk} blocks"
    for what, n in rows.items():
        if n % (bn * tp_size):
            return f"{what} {n} at tp_size {tp_size} are not whole blocks of {bn} rows on each rank"
    for what, n in cols.items():
        if n % (bk * tp_size):
            return f"{what} {n} at tp_size {tp_size} are not whole blocks of {bk} columns on each rank"
    return None


def kv_bytes_per_block(args: ModelArgs, tp_size: int, block_size: int, dtype: str) -> int:
    """Bytes of one KV block on one rank (every layer's keys and values), as CausalLM.kv_bytes_per_block."""
    return args.num_hidden_layers * 2 * (args.num_key_value_heads // tp_size) * block_size * args.head_dim \
        * DTYPE_BYTES[dtype]
