"""A checkpoint's quantization as the fingerprint names it: the method, a hash of its config, and the
version of the post-load processing the daemon ran (models/quant.py says what is computed;
anything else is refused when config.json is read, in every weight_cache_mode)."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from models.quant import PROCESSING_VERSION


def quant_of(config: dict[str, Any]) -> tuple[str | None, str, str]:
    """(quant_method, hash of quantization_config, processing version) from a parsed config.json;
    (None, "", "") if unquantized."""
    qc = config.get("quantization_config")
    if not qc:
        return None, "", ""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ValueError("quantization_config has no quant_method string")
    digest = hashlib.sha256(json.dumps(qc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return method, digest[:16], PROCESSING_VERSION
