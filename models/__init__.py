"""Built-in models: one Llama-family decoder, buildable on meta, tensor parallel.

The checkpoint's arguments and errors import without torch (the supervisor's preflight reads them);
the model itself, on first use of its names."""
from importlib import import_module

from .args import SUPPORTED_ARCHS, ModelArgs, read_model_args
from .errors import CheckpointError, UnknownArchError

_WITH_TORCH = {"CausalLM": ".causal_lm", "ShardSpec": ".decoder", "AttnMeta": ".paged", "build_model": ".registry",
               "torch_dtype": ".registry"}

__all__ = ["SUPPORTED_ARCHS", "ModelArgs", "read_model_args", "CheckpointError", "UnknownArchError",
           *_WITH_TORCH]


def __getattr__(name: str) -> object:
    if name in _WITH_TORCH:
        return getattr(import_module(_WITH_TORCH[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
