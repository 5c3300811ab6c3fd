"""Built-in models: one Llama-family decoder, buildable on meta, tensor parallel."""
from .args import SUPPORTED_ARCHS, ModelArgs, read_model_args
from .errors import CheckpointError, UnknownArchError
from .llama import CausalLM, Decode, Prefill, ShardSpec
from .registry import build_model, torch_dtype

__all__ = ["SUPPORTED_ARCHS", "ModelArgs", "read_model_args", "CheckpointError", "UnknownArchError",
           "CausalLM", "Decode", "Prefill", "ShardSpec", "build_model", "torch_dtype"]
