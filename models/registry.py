"""Model registry: which architectures the built-in engine runs, and how to build one."""
from __future__ import annotations

import torch

from .args import SUPPORTED_ARCHS, ModelArgs
from .errors import UnknownArchError
from .causal_lm import CausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; errors list the accepted names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported (expected one of {', '.join(_DTYPES)})") from None


def build_model(args: ModelArgs, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "meta") -> CausalLM:
    """Build rank `tp_rank` of the model (default on meta: shapes only, no memory)."""
    if args.arch not in SUPPORTED_ARCHS:
        raise UnknownArchError(f"architecture {args.arch!r} is not supported")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    return CausalLM(args, tp_rank, tp_size, dtype, device)
