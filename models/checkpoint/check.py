"""What a quantized (or falsely unquantized) checkpoint's tensors say against its config.json, from the
safetensors headers alone (no torch, no weights read): the preflight's check, so that `serve --check`
and `serve` refuse with one line what the loader would refuse later (daemon/loader.py checks the
same while it reads). Each problem names the file and the tensor."""
from __future__ import annotations

from pathlib import Path

from models.args import ModelArgs
from .header import tensor_entries

FP8 = ("F8_E4M3", "F8_E5M2")
FLOATS = ("F32", "BF16", "F16")
SCALES = (".weight_scale_inv", ".weight_scale", ".input_scale")
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def quant_problem(model_dir: Path, args: ModelArgs) -> str | None:
    """The first tensor that contradicts config.json's quantization, or None."""
    tensors = tensor_entries(model_dir)
    scheme = args.quant
    for key, (dtype, shape, file) in sorted(tensors.items()):
        module, _, leaf = key.rpartition(".")
        if dtype in FP8:
            if scheme is None:
                return f"{file}: tensor {key} is {dtype}, but config.json declares no quantization_config"
            if dtype != "F8_E4M3":
                return f"{file}: tensor {key} is {dtype}; FP8 weights must be float8_e4m3fn (F8_E4M3)"
            if leaf != "weight" or module.rpartition(".")[2] not in LINEAR_LEAVES:
                return f"{file}: tensor {key} is FP8, but this engine quantizes only the layers' projections"
            scale = f"{module}.{scheme.scale_name}"
            if scale not in tensors:
                return f"{file}: FP8 tensor {key} has no scale {scale}"
            if (why := _scale_problem(tensors[scale], shape, scheme)) is not None:
                return f"{tensors[scale][2]}: scale {scale} {why}"
            if scheme.activations == "static" and f"{module}.input_scale" not in tensors:
                return f"{file}: FP8 tensor {key} has no input_scale (activation_scheme static)"
        elif key.endswith(SCALES):
            weight = key[:key.rindex(".")] + ".weight"
            if weight not in tensors or tensors[weight][0] not in FP8:
                return f"{file}: tensor {key} is a quantization scale of no FP8 weight ({weight} is " \
                       f"{tensors[weight][0] if weight in tensors else 'missing'})"
        elif scheme is not None and leaf == "weight" and module.rpartition(".")[2] in LINEAR_LEAVES \
                and ".layers." in f".{module}" and scheme.quantizes(module):
            return f"{file}: tensor {key} is {dtype}, but quantization_config makes it FP8 (no ignored module names it)"
    return None


def _scale_problem(scale: tuple[str, tuple[int, ...], Path], weight_shape: tuple[int, ...], scheme) -> str | None:  # noqa: ANN001
    dtype, shape, _ = scale
    if dtype not in FLOATS:
        return f"is {dtype}, expected a float (F32)"
    n, k = weight_shape if len(weight_shape) == 2 else (0, 0)
    if scheme.kind == "block":
        bn, bk = scheme.block
        want = (-(-n // bn), -(-k // bk))
        if shape != want:
            return f"has shape {list(shape)}, expected {list(want)} (one per {bn}x{bk} block of a {n}x{k} weight)"
    elif shape not in ((), (1,), (n,), (n, 1)):
        return f"has shape {list(shape)}, expected one value or {n} (per tensor or per output row)"
    return None
