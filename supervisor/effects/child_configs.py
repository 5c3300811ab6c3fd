"""What each child is started with, from the node's config: an engine's EngineConfig (or an external
engine's command line), a daemon's and the spawn server's argv; and their config keys (a recorded
child started with another key is never re-adopted)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from daemon.cli import daemon_argv
from wire.engine_config import EngineConfig
from wire import node_secret
from wire.guarded_http import ListenerLimits
from wire.loopback import free_port
from supervisor.config import UnderstudyConfig, daemon_template_fields, template_fields
from supervisor.core.adoption_plan import Wanted
from supervisor.core.records import config_key
from supervisor.effects.processes import python_argv

ENGINE_SLACK = 64  # an engine's listener: the router's pool plus probes and canaries
ENGINE_VOLATILE = {"port", "incarnation", "dist_port", "control_endpoint"}  # differ per incarnation


@dataclass(frozen=True)
class ChildConfigs:
    """The node's config, the model resolved (path, device) and the runtime dir."""

    cfg: UnderstudyConfig
    model_path: Path
    device: str
    rd: Path
    control_endpoint: str = ""

    @property
    def external(self) -> bool:
        return self.cfg.engines.kind == "external"

    @property
    def model_name(self) -> str:
        return self.cfg.model.name or self.model_path.name

    def engine(self, name: str, incarnation: int, port: int) -> EngineConfig:
        e, m = self.cfg.engines, self.cfg.model
        return EngineConfig(
            name=name, model_path=str(self.model_path), tp_size=m.tp_size, dtype=m.dtype, device=self.device,
            node_secret_file=str(self.rd / node_secret.FILE),
            gpu_ids=self.cfg.resolved_gpu_ids() if self.device == "cuda" else [], host="127.0.0.1", port=port,
            weight_cache_mode=e.weight_cache_mode, runtime_dir=str(self.rd), control_endpoint=self.control_endpoint,
            incarnation=incarnation, kv_cache_bytes=e.kv_cache_bytes, max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len, max_num_batched_tokens=e.max_num_batched_tokens,
            max_prefill_tokens_per_step=e.max_prefill_tokens_per_step,
            kv_block_size=e.kv_block_size, prefix_caching=e.prefix_caching, shared_kv=self.cfg.shares_kv(),
            kv_slot=e.slot_names().index(name), kv_tails=e.kv_tails, cuda_graphs=e.cuda_graphs,
            cuda_graphs_before_ready=e.cuda_graphs_before_ready,
            fused_kernels=e.fused_kernels, deterministic=e.deterministic, heartbeat_interval_s=e.heartbeat_interval_s,
            dist_port=free_port() if m.tp_size > 1 else 0, served_model_name=self.model_name,
            limits=self.cfg.limits.request_limits(),
            listener=ListenerLimits(max_connections=self.cfg.router.max_connections + ENGINE_SLACK,
                                    header_timeout_s=self.cfg.limits.header_timeout_s))

    def external_engine(self, name: str, port: int) -> tuple[list[str], str, dict[str, str]]:
        """(argv, url, extra env) of an external engine listening on ``port``."""
        ext = self.cfg.engines.external
        fields = template_fields(port, str(self.model_path), name, self.model_name, self.cfg.resolved_gpu_ids(),
                                 str(self.rd))
        return [a.format(**fields) for a in shlex.split(ext.command)], ext.url.format(**fields).rstrip("/"), ext.env

    def daemon(self, rank: int) -> list[str]:
        """A rank's daemon: the weights, and with shared KV the node's pool (kv_cache_bytes); with external
        engines, their own daemon's command line (engines.external.daemon_command)."""
        if self.external:
            return [a.format(**self._daemon_fields(rank)) for a in shlex.split(self.cfg.engines.external.daemon_command)]
        m, e = self.cfg.model, self.cfg.engines
        gpu = self.cfg.resolved_gpu_ids()[rank] if self.device == "cuda" else None
        pool = e.kv_cache_bytes if self.cfg.shares_kv() else 0
        return daemon_argv(self.model_path, rank, m.tp_size, self.device, m.dtype, self.rd, gpu, pool,
                           e.kv_block_size, e.count)

    def daemon_env(self) -> dict[str, str]:
        """What a daemon gets beside our environment: an external engine's env (the same GPUs as its engines)."""
        return dict(self.cfg.engines.external.env) if self.external else {}

    def daemon_ready(self, rank: int) -> str:
        """Where a rank's daemon is checked: our socket's path, or an external daemon's readiness check filled."""
        if self.external:
            return self.cfg.engines.external.daemon_ready.format(**self._daemon_fields(rank))
        from daemon.runtime_dir import daemon_socket_path
        return str(daemon_socket_path(self.rd, rank))

    def _daemon_fields(self, rank: int) -> dict[str, str]:
        return daemon_template_fields(rank, str(self.model_path), self.model_name, self.cfg.resolved_gpu_ids(),
                                      self.cfg.model.tp_size, str(self.rd))

    def spawn_server(self) -> list[str]:
        return python_argv("engines.process.spawn_server", "--socket", str(self.rd / "spawn.sock"),
                           "--tokenizer", str(self.model_path))

    def wanted(self, engines: list[str], ranks: int, spawn_server: bool, fingerprint: str) -> Wanted:
        """The config key of every slot (what a recorded child must have been started with)."""
        daemons = {f"daemon-rank{r}": config_key(argv=self.daemon(r), fingerprint=fingerprint) for r in range(ranks)}
        keys = {}
        for name in engines:
            if self.external:
                ext = self.cfg.engines.external
                what = {"command": ext.command, "url": ext.url, "env": ext.env}
            else:
                what = self.engine(name, 0, 0).model_dump(exclude=ENGINE_VOLATILE)
            keys[name] = config_key(engine=what, spawn=self.cfg.engines.spawn, fingerprint=fingerprint)
        spawn = config_key(argv=self.spawn_server()) if spawn_server else None
        return Wanted(daemons, keys, spawn)
