"""UnderstudyConfig: the single source of config truth (DESIGN.md §8, uvicorn style).

Loading and error formatting live in ``supervisor/config_load.py``; this file is only the schema.
Every section forbids unknown keys, so a typo is an error with its path, not a silent default.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from wire.limits import RequestLimits


def _local_path(value: str | None) -> str | None:
    """A path on this machine: no NUL byte, and a leading ~user that names a user."""
    if value is None:
        return None
    if "\0" in value:
        raise ValueError("expected a path, got one with a NUL byte")
    try:
        Path(value).expanduser()
    except RuntimeError:  # (~nosuchuser, or ~ without a home)
        raise ValueError(f"{value.split('/')[0]!r} names no home folder here") from None
    return value


LocalPath = Annotated[str | None, AfterValidator(_local_path)]  # a config path (null: its default)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """The checkpoint every engine serves."""

    path: LocalPath = Field(default=None, description="HF checkpoint folder; null = built-in model made under cache_dir")
    preset: Literal["tiny", "small", "1b"] = Field(default="tiny", description="preset made when path is null")
    name: str | None = Field(default=None, description="model id on /v1/models; null = folder name")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tp_size: int = Field(default=1, ge=1, le=64)


def template_fields(port: int, model: str, name: str, model_name: str, gpu_ids: list[int],
                    runtime_dir: str = "") -> dict[str, str]:
    """The placeholders an external engine's command and URL templates may use."""
    return {"port": str(port), "model": model, "name": name, "model_name": model_name,
            "gpu_ids": ",".join(map(str, gpu_ids)), "runtime_dir": runtime_dir}


def daemon_template_fields(rank: int, model: str, model_name: str, gpu_ids: list[int], tp_size: int,
                           runtime_dir: str) -> dict[str, str]:
    """The placeholders an external daemon's command and readiness check may use: ``gpu_id`` is the
    rank's GPU (``gpu_ids[rank]``), ``gpu_ids`` every rank's."""
    gpu = gpu_ids[rank] if rank < len(gpu_ids) else rank
    return {"rank": str(rank), "gpu_id": str(gpu), "gpu_ids": ",".join(map(str, gpu_ids)), "tp_size": str(tp_size),
            "model": model, "model_name": model_name, "runtime_dir": runtime_dir}


def _fill_check(v: str, fields: dict[str, str]) -> list[str]:
    """``v`` split as a command line and each part filled; ValueError names an unknown placeholder."""
    import shlex
    try:
        parts = shlex.split(v)
    except ValueError as e:
        raise ValueError(f"not a valid template: {e}") from None
    return [_fill_one(part, fields) for part in parts]


class ExternalEngine(_Section):
    """An engine we start by command template and talk to by URL (vLLM, SGLang, ...), and optionally its
    own weight cache daemon, which the supervisor runs and watches as it does its own daemons."""

    command: str = Field(min_length=1, description="no shell; {port} {model} {name} {model_name} {gpu_ids} "
                         "{runtime_dir} are filled")
    url: str = Field(default="http://127.0.0.1:{port}", description="base URL template")
    env: dict[str, str] = Field(default_factory=dict, description="for the engines and the daemons")
    daemon_command: str | None = Field(default=None, min_length=1, description="the engine's own weight cache "
                                       "daemon (no shell; {rank} {gpu_id} {gpu_ids} {tp_size} {model} {model_name} "
                                       "{runtime_dir} are filled): started before the engines, restarted with "
                                       "backoff when it exits; null: none")
    daemon_ready: str | None = Field(default=None, description="when the daemon is READY (engines start after "
                                     "it): unix:PATH, tcp:HOST:PORT, http(s)://URL (200) or log:REGEX (a line of "
                                     "its log); the daemon_command's placeholders are filled")
    daemon_scope: Literal["node", "rank"] = Field(default="node", description="node: one daemon for all the "
                                                  "model's ranks (vLLM's and SGLang's launchers start one process "
                                                  "per GPU themselves); rank: one per rank (model.tp_size)")

    @field_validator("command", "url")
    @classmethod
    def _template(cls, v: str) -> str:
        _fill_check(v, template_fields(1, "m", "n", "m", [0], "/rt"))
        return v

    @field_validator("daemon_command")
    @classmethod
    def _daemon_template(cls, v: str | None) -> str | None:
        if v is not None and not _fill_check(v, daemon_template_fields(0, "m", "m", [0], 1, "/rt")):
            raise ValueError("expected a command line, got none")
        return v

    @field_validator("daemon_ready")
    @classmethod
    def _ready(cls, v: str | None) -> str | None:
        if v is not None:
            from supervisor.ready_spec import parse_ready
            parse_ready(_fill_one(v, daemon_template_fields(0, "m", "m", [0], 1, "/rt")))
        return v

    @model_validator(mode="after")
    def _daemon_pair(self) -> "ExternalEngine":
        if self.daemon_command is not None and self.daemon_ready is None:
            raise ValueError("daemon_ready: required with daemon_command (when is the daemon READY: unix:PATH, "
                             "tcp:HOST:PORT, http://URL or log:REGEX)")
        if self.daemon_ready is not None and self.daemon_command is None:
            raise ValueError("daemon_ready: given without daemon_command")
        return self


def _fill_one(v: str, fields: dict[str, str]) -> str:
    """A template filled whole (not split as a command line: a readiness check is one string)."""
    try:
        return v.format(**fields)
    except KeyError as e:
        raise ValueError(f"unknown placeholder {{{e.args[0]}}} (known: {', '.join(fields)}; "
                         "write {{ and }} for literal braces)") from None
    except (ValueError, IndexError) as e:
        raise ValueError(f"not a valid template: {e}") from None


ENGINE_NAME = r"^[A-Za-z0-9_.-]{1,32}$"
"""What an engine slot may be called (EngineConfig.name's pattern: it names files and log lines)."""


class EnginesSection(_Section):
    """The engine slots: one primary, the others standby."""

    count: int = Field(default=2, ge=1, le=16)
    names: list[str] | None = Field(default=None, description="slot names; default a, b, c, ...")
    kind: Literal["builtin", "external"] = "builtin"
    spawn: Literal["server", "direct"] = Field(default="server", description="fork from the spawn server, or exec python -m engines")
    weight_cache_mode: Literal["client", "daemon", "off"] = "client"
    kv_cache_bytes: int = Field(default=64 << 20, ge=1 << 16, description="KV cache per GPU rank: with "
                                "shared_kv the node's one pool (the daemon's, used whole by the primary), "
                                "else each engine's own")
    shared_kv: bool = Field(default=True, description="the KV cache lives in the daemons, shared by the engines: "
                            "the standby is parked (no KV of its own) and continues every stream from the dead "
                            "primary's blocks (builtin engines with daemons and weight_cache_mode client)")
    kv_tails: bool = Field(default=False, description="with shared_kv, the primary names every stream's last "
                           "partial block in the pool's index each step: a stream continued after a kill then "
                           "recomputes one token instead of up to kv_block_size - 1, for some of the primary's "
                           "CPU time every step (about 5% of chat:32 throughput with the 1b preset on an H200; "
                           "hidden where steps are long: large models)")
    max_num_seqs: int = Field(default=16, ge=1)
    max_model_len: int = Field(default=512, ge=16)
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    max_prefill_tokens_per_step: int | None = Field(
        default=None, ge=1, description="prefill tokens a step adds beside its decode rows (a failover's "
        "continuations aside): bounds a running stream's wait for its next token; default (null): no cap beyond the step's "
        "budget (a cap's cost to throughput on a GPU is not yet measured)")
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="positions per KV block (a power of two)")
    prefix_caching: bool = True
    cuda_graphs: bool = True
    cuda_graphs_before_ready: Literal["largest", "all"] = Field(
        default="largest", description="the CUDA graphs captured before the engine says it is ready: `largest`, the largest decode-only and mixed graph (every step fits one; the others are captured when it has time, at once while idle, else one a second, a pause of ~0.1 s: a restarted standby is ready sooner), or `all` (with tp_size > 1, always all)")
    fused_kernels: bool = Field(default=True, description="decode small batches through the Triton kernels (CUDA)")
    deterministic: bool = Field(default=False, description="batch-invariant engines: the same request gives the "
                                "same text under any load and across a failover's continuation, bit for bit")
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    external: ExternalEngine | None = None

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"expected a power of two (1, 2, 4, ... 1024), got {v}")
        return v

    @field_validator("names")
    @classmethod
    def _slot_names(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if not re.fullmatch(ENGINE_NAME, name):
                raise ValueError("expected names of 1-32 letters, digits, '_', '.' or '-' (a name is part of the "
                                 f"engine's file names and log lines), got {name[:40]!r}" + ("..." * (len(name) > 40)))
        return v

    @model_validator(mode="after")
    def _check(self) -> "EnginesSection":
        if self.names is not None:
            if len(self.names) != self.count:
                raise ValueError(f"names: expected {self.count} names (engines.count), got {len(self.names)}")
            if len(set(self.names)) != len(self.names):
                raise ValueError("names: expected unique names")
        if self.kind == "external" and self.external is None:
            raise ValueError("external: required when kind is 'external'")
        return self

    def slot_names(self) -> list[str]:
        """Slot names, explicit or a, b, c..."""
        return list(self.names) if self.names else [chr(ord("a") + i) for i in range(self.count)]


class DaemonsSection(_Section):
    """The per-rank weight cache daemons."""

    enabled: bool = True
    load_timeout_s: float = Field(default=600.0, gt=0)


CUDA_HEARTBEAT_TIMEOUT_S = 1.0
CPU_HEARTBEAT_TIMEOUT_S = 5.0
HEARTBEAT_MARGIN = 2
"""failover.heartbeat_timeout_s (as resolved for the device) must be at least this many engines.heartbeat_interval_s."""


class FailoverSection(_Section):
    """Detection, hold and restart policy."""

    heartbeat_timeout_s: float | None = Field(default=None, gt=0, description="no heartbeat for this long = a "
                                              "hung engine; null = 1 s on CUDA, 5 s on CPU and for external engines")
    exit_poll_ms: float = Field(default=5.0, ge=0, description="how often the primary is checked for a "
                                "started exit (0 = only the pidfd, which fires after GPU teardown)")
    startup_timeout_s: float = Field(default=300.0, gt=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    probe_timeout_s: float = Field(default=10.0, gt=0)
    probe_failures: int = Field(default=2, ge=1)
    hold_timeout_s: float = Field(default=30.0, gt=0)
    retry_after_s: int = Field(default=5, ge=1)
    drain_timeout_s: float = Field(default=30.0, gt=0)
    stop_timeout_s: float = Field(default=10.0, gt=0)
    restart_delay_s: float = Field(default=0.0, ge=0, le=60, description="the wait before an engine that "
                                   "crashed once after READY starts again (later failures in a row back off "
                                   "from backoff_base_s); a delay keeps its start off the GPU while the new "
                                   "primary takes the streams over")
    backoff_base_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    flap_window_s: float = Field(default=120.0, gt=0)
    flap_max: int = Field(default=5, ge=1)
    fatal_retry_s: float | None = Field(default=300.0, gt=0, description="a FATAL engine slot (flapping or a boot "
                                        "error while another engine serves) is tried once again this often; "
                                        "null = only `understudy restart NAME`")
    stuck_after_s: float | None = Field(default=None, gt=0, description="no READY primary and no progress "
                                        "for this long = stuck: the systemd watchdog is no longer fed; "
                                        "null = startup_timeout_s + 4 x backoff_max_s")

    def heartbeat_timeout_for(self, device: str) -> float:
        """``heartbeat_timeout_s``, or its default for ``device`` (resolved: cuda, cpu or external). On
        CUDA 1 s (measured on an H200: no false failover under 256 clients with 1,000-1,900-token
        prompts, and a SIGSTOPped primary served again within 1.0 s); on CPU a loaded 2-core box can
        pause the scheduler's heartbeat thread for seconds, so 5 s."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return CUDA_HEARTBEAT_TIMEOUT_S if device == "cuda" else CPU_HEARTBEAT_TIMEOUT_S

    def for_device(self, device: str) -> "FailoverSection":
        """This section with the defaults that depend on the device filled in."""
        return self.model_copy(update={"heartbeat_timeout_s": self.heartbeat_timeout_for(device)})

    def stuck_window_s(self) -> float:
        """``stuck_after_s``, or its default."""
        return self.stuck_after_s if self.stuck_after_s is not None else self.startup_timeout_s + 4 * self.backoff_max_s


class CanarySection(_Section):
    """The fixed greedy completion that decides readiness."""

    prompt: str = Field(default="The quick brown fox", min_length=1)
    max_tokens: int = Field(default=4, ge=1, le=64)


class ListenSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)


class MigrationSection(_Section):
    """Continuing in-flight requests on the new primary when the primary is lost mid-response."""

    enabled: bool = Field(default=True, description="false: requests pass through untouched (a stream cut "
                          "mid-response ends with an error event)")
    max_migrations: int = Field(default=10, ge=0, description="continuations of one request at most: how many "
                                "failovers a request may ride (one that kills engines is quarantined after two)")
    max_replay_tokens: int = Field(default=32768, ge=1, description="prompt + emitted tokens a continuation "
                                   "may replay at most; a longer request ends with an explicit error")
    batch: bool = Field(default=True, description="the continuations of one failover go to the new primary as "
                        "one request (POST /v1/continuations), their streams in one response; false: a "
                        "request each")


class RouterSection(ListenSection):
    """The data plane."""

    upstream_timeout_s: float = Field(default=600.0, gt=0)
    max_connections: int = Field(default=1024, ge=1)
    migration: MigrationSection = Field(default_factory=MigrationSection)


class AdminSection(ListenSection):
    """The admin API."""

    port: int = Field(default=8001, ge=0, le=65535)
    token_file: LocalPath = Field(default=None, description="null = {runtime_dir}/admin.token")
    allow_remote: bool = Field(default=False, description="allow a non-loopback admin.host")

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> "AdminSection":
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"host: {self.host!r} is not a loopback address; the admin API has full control "
                             "of the node (promote, drain, restart): bind it to 127.0.0.1 or ::1, or set "
                             "admin.allow_remote: true to expose it (the bearer token is then its only guard)")
        return self


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LimitsSection(RequestLimits):
    """What one client may ask: request limits (router and engines) and connection hygiene
    (router and admin listeners). Every refusal names its key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_client_connections: int = Field(default=4096, ge=1, description="open connections on the router; "
                                        "more are closed on accept (lowered to fit the open-files limit)")
    admin_max_connections: int = Field(default=64, ge=1)
    peer_connection_share: float = Field(default=0.5, gt=0, le=1, description="router and admin: the share of "
                                         "the listener's cap one client address (IPv6: its /64) may hold; a client "
                                         "at its share, or any new one on a full listener, makes an idle connection "
                                         "close (unauthenticated; refused only if none is idle); 1: no share (behind "
                                         "a proxy every client has its address)")
    header_timeout_s: float = Field(default=10.0, gt=0, description="connect -> whole request head, else closed")
    body_timeout_s: float = Field(default=30.0, gt=0, description="router: request head -> whole body, else 408")
    keepalive_timeout_s: float = Field(default=30.0, gt=0, description="router/admin: idle keep-alive connections close")

    def request_limits(self) -> RequestLimits:
        """The part an engine enforces."""
        return RequestLimits(**{k: getattr(self, k) for k in RequestLimits.model_fields})


class UnderstudyConfig(_Section):
    """Everything `understudy serve` needs."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpu_ids: list[int] = Field(default_factory=list, description="rank i on cuda:gpu_ids[i]; empty = 0..tp-1")
    runtime_dir: LocalPath = Field(default=None, description="null = $XDG_RUNTIME_DIR/understudy or /tmp/understudy-$UID")
    cache_dir: LocalPath = Field(default=None, description="null = $UNDERSTUDY_CACHE_DIR, else $XDG_CACHE_HOME/understudy or ~/.cache/understudy")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    model: ModelSection = Field(default_factory=ModelSection)
    engines: EnginesSection = Field(default_factory=EnginesSection)
    daemons: DaemonsSection = Field(default_factory=DaemonsSection)
    failover: FailoverSection = Field(default_factory=FailoverSection)
    canary: CanarySection = Field(default_factory=CanarySection)
    router: RouterSection = Field(default_factory=RouterSection)
    admin: AdminSection = Field(default_factory=AdminSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)

    @model_validator(mode="after")
    def _check(self) -> "UnderstudyConfig":
        r, a = self.router, self.admin
        if r.port and r.port == a.port and r.host == a.host:
            raise ValueError(f"admin.port: expected a port other than router.port, got {a.port}")
        if self.gpu_ids and len(self.gpu_ids) < self.model.tp_size:
            raise ValueError(f"gpu_ids: expected at least model.tp_size={self.model.tp_size} ids, got {self.gpu_ids}")
        if self.failover.heartbeat_timeout_s is not None or self.device != "auto":  # (auto: preflight, which resolves it)
            if problem := self.heartbeat_problem(self.device if self.device != "auto" else "cpu"):
                raise ValueError(problem)
        return self

    def heartbeat_problem(self, device: str) -> str | None:
        """Why the heartbeat timeout resolved for ``device`` cannot work with the engines' heartbeat
        interval (None: it can). A timeout under HEARTBEAT_MARGIN intervals would see a healthy engine,
        one heartbeat late or early, as hung: every engine judged hung in turn, and no key named."""
        if self.engines.kind != "builtin":  # (an external engine sends no heartbeats: probes judge it)
            return None
        f, interval = self.failover, self.engines.heartbeat_interval_s
        timeout = f.heartbeat_timeout_for(device)
        if timeout >= HEARTBEAT_MARGIN * interval:
            return None
        value = f"{timeout:g}" if f.heartbeat_timeout_s is not None else f"null (= {timeout:g} s on {device})"
        return (f"failover.heartbeat_timeout_s: expected at least {HEARTBEAT_MARGIN} x engines.heartbeat_interval_s "
                f"({HEARTBEAT_MARGIN} x {interval:g} = {HEARTBEAT_MARGIN * interval:g} s), got {value}: engines "
                "heartbeating that seldom would all look hung; raise failover.heartbeat_timeout_s or lower "
                "engines.heartbeat_interval_s")

    # ---- derived values (never stored back) ----
    def shares_kv(self) -> bool:
        """The engines run on the daemons' shared KV pools (it needs our engines and our daemons)."""
        e = self.engines
        return e.shared_kv and e.kind == "builtin" and self.daemons.enabled and e.weight_cache_mode == "client"

    def daemon_ranks(self) -> int:
        """How many weight cache daemons the supervisor runs: ours, one per rank (engines in client mode);
        an external engine's (engines.external.daemon_command), one per node or per rank; else none."""
        if not self.daemons.enabled:
            return 0
        ext = self.engines.external
        if self.engines.kind == "external":
            if ext is None or ext.daemon_command is None:
                return 0
            return 1 if ext.daemon_scope == "node" else self.model.tp_size
        return self.model.tp_size if self.engines.weight_cache_mode == "client" else 0

    def resolved_runtime_dir(self) -> Path:
        if self.runtime_dir:
            return Path(self.runtime_dir).expanduser()
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        return Path(xdg) / "understudy" if xdg else Path(f"/tmp/understudy-{os.getuid()}")

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        if os.environ.get("UNDERSTUDY_CACHE_DIR"):  # as daemon/fingerprint.py
            return Path(os.environ["UNDERSTUDY_CACHE_DIR"])
        xdg = os.environ.get("XDG_CACHE_HOME")
        return (Path(xdg) if xdg else Path.home() / ".cache") / "understudy"

    def resolved_token_file(self) -> Path:
        return Path(self.admin.token_file).expanduser() if self.admin.token_file else self.resolved_runtime_dir() / "admin.token"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        try:
            import torch
            return "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:  # torch missing or broken: CPU is always possible
            return "cpu"

    def resolved_gpu_ids(self) -> list[int]:
        return list(self.gpu_ids) if self.gpu_ids else list(range(self.model.tp_size))
