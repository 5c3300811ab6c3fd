"""EngineConfig: everything one engine process needs, passed as JSON by its starter."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.guarded_http import ListenerLimits
from wire.limits import RequestLimits

WeightCacheMode = Literal["client", "daemon", "off"]
BOOT_ERROR_EXIT = 3
"""An engine's exit code for a configuration or checkpoint problem: restarting it will not help."""


def step_token_budget(cfg: "EngineConfig") -> int:
    """The configured token budget of a step, or the device's default."""
    return cfg.max_num_batched_tokens or (2048 if cfg.device == "cuda" else 256)


class EngineConfig(BaseModel):
    """One engine (all of its TP ranks). The supervisor fills it; the engine never guesses."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    model_path: str
    tp_size: int = Field(default=1, ge=1, le=64)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    gpu_ids: list[int] = Field(default_factory=list, description="rank i runs on cuda:gpu_ids[i]")
    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    weight_cache_mode: WeightCacheMode = "off"
    runtime_dir: str
    node_secret_file: str | None = Field(default=None, description="serve only requests carrying this file's "
                                         "secret (wire/node_secret.py; set by the supervisor), or anyone (null)")
    control_endpoint: str | None = None
    incarnation: int = 0
    kv_cache_bytes: int = Field(default=64 << 20, ge=1 << 16)
    max_num_seqs: int = Field(default=16, ge=1)
    max_model_len: int = Field(default=512, ge=16)
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, description="token budget of one step (decode rows + prefill chunks); "
        "default: 2048 on CUDA, 256 on CPU")
    max_prefill_tokens_per_step: int | None = Field(
        default=None, ge=1, description="prefill tokens a step adds beside its decode rows (a failover's "
        "continuations aside), so a running stream waits about a decode step; default: the step's budget "
        "(no cap)")
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="positions per KV block (a power of two)")
    prefix_caching: bool = Field(default=True, description="share full blocks across requests by key")
    shared_kv: bool = Field(default=False, description="run on the ranks' shared KV pools (their daemons'), "
                            "parked until promoted; else (or if a pool is missing) allocate kv_cache_bytes")
    kv_slot: int = Field(default=0, ge=0, description="this engine's scratch slot in the shared pools")
    kv_tails: bool = Field(default=False, description="as the shared pools' writer, name every sequence's "
                           "last partial block in the index each step (engines/core/tail_publisher.py)")
    cuda_graphs: bool = True
    cuda_graphs_before_ready: Literal["largest", "all"] = Field(
        default="largest", description="the CUDA graphs captured before the engine says it is ready: `largest`, the largest decode-only and mixed graph (every step fits one; the others are captured when it has time, at once while idle, else one a second, a pause of ~0.1 s: a restarted standby is ready sooner), or `all` (with tp_size > 1, always all)")
    fused_kernels: bool = Field(default=True, description="decode small batches through the Triton kernels (CUDA)")
    deterministic: bool = Field(default=False, description="batch-invariant ops: a request's text does not depend "
                                "on the other requests, prefill chunks or prefix-cache hits (models/invariant.py)")
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    dist_port: int = Field(default=0, ge=0, le=65535)
    limits: RequestLimits = Field(default_factory=RequestLimits, description="per-request limits (400/413)")
    listener: ListenerLimits = Field(default_factory=ListenerLimits, description="the HTTP listener's connection limits")
    served_model_name: str | None = Field(
        default=None, description="the `model` name clients use; default: the model folder's basename")
