"""Which quantization methods may share weights through the cache daemon.

A method is allowed only if its post-load processing is a pure function of tensors that stays
inside the arena (no Python-side state, no repacked copies outside it). Unquantized checkpoints
are always allowed.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

# fp8 checkpoints (e4m3 weights + per-tensor/per-channel scales) load as plain tensors: the scales
# are parameters like any other. Methods that repack weights into kernel-specific layouts at load
# time (gptq, awq, marlin, bitsandbytes, ...) keep state outside the arena and are refused.
QUANT_WHITELIST: frozenset[str] = frozenset({"fp8"})


class UnsupportedQuantForIPCError(Exception):
    """The checkpoint's quant method cannot be shared through the weight cache."""


def quant_of(config: dict[str, Any]) -> tuple[str | None, str]:
    """(quant_method, hash of quantization_config) from a parsed config.json; (None, "") if unquantized."""
    qc = config.get("quantization_config")
    if not qc:
        return None, ""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ValueError("quantization_config has no quant_method string")
    digest = hashlib.sha256(json.dumps(qc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return method, digest[:16]


def check_quant_allowed(quant_method: str | None, where: str = "config.json") -> None:
    """Raise UnsupportedQuantForIPCError unless `quant_method` is None or whitelisted."""
    if quant_method is None or quant_method in QUANT_WHITELIST:
        return
    allowed = ", ".join(sorted(QUANT_WHITELIST))
    raise UnsupportedQuantForIPCError(
        f"{where}: quant_method {quant_method!r} cannot use the weight cache (allowed: unquantized, "
        f"{allowed}); set weight_cache_mode to 'off'")
