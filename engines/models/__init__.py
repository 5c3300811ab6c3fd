"""Built-in models: one Llama-family decoder, buildable on meta, tensor parallel."""
from .args import SUPPORTED_ARCHS, ModelArgs, read_model_args
from .errors import CheckpointError, UnknownArchError
from .llama import CausalLM, ShardSpec
from .paged import AttnMeta
from .registry import build_model, torch_dtype

__all__ = ["SUPPORTED_ARCHS", "ModelArgs", "read_model_args", "CheckpointError", "UnknownArchError",
           "AttnMeta", "CausalLM", "ShardSpec", "build_model", "torch_dtype"]
