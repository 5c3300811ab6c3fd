"""Prometheus metrics (DESIGN.md §5 names, prefix ``understudy_``), on a registry of our own."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from wire.stream_timing import FIRST_OUTPUT_BUCKETS

_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SLOW = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
RECOMPUTED_BUCKETS = (0, 1, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536)


# (metric name after understudy_engine_, heartbeat field, help): an engine's gauges on the node's /metrics
ENGINE_FIGURES = (
    ("running_seqs", "running", "Sequences running"), ("waiting_seqs", "waiting", "Sequences waiting"),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks in use"), ("kv_blocks_total", "kv_blocks_total", "KV cache blocks"),
    ("preemptions", "preemptions", "Sequences preempted since the engine started"),
    ("kv_quarantined_blocks", "kv_quarantined_blocks",
     "Shared KV blocks a dead writer left unfinished, not reused until its processes are gone"),
    ("gpu_reserved_bytes", "gpu_reserved_bytes",
     "GPU memory the engine's allocator holds (graphs included; not the CUDA context, weights or shared pool)"),
    ("cuda_graphs_pending", "cuda_graphs_pending",
     "CUDA graphs left to capture after READY (engines.cuda_graphs_before_ready: captured when it has time)"))


class Metrics:
    """All supervisor metrics; ``render()`` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.failovers = Counter("understudy_failovers", "Primary switches, by reason", ["reason"], registry=r)
        self.failover_seconds = Histogram("understudy_failover_seconds",
                                          "Failure detected -> new primary serving", buckets=_FAST, registry=r)
        self.recovery_seconds = Histogram("understudy_recovery_seconds",
                                          "Failure -> replacement engine READY (recovery SLO)", buckets=_SLOW, registry=r)
        self.weight_cache = Counter("understudy_weight_cache_requests", "Engine weight attaches by result",
                                    ["result", "reason"], registry=r)
        self.startup_phase = Histogram("understudy_engine_startup_phase_seconds", "Engine startup phases",
                                       ["phase"], buckets=_FAST + (60, 120, 300), registry=r)
        self.active_engines = Gauge("understudy_active_engines", "Engines serving as primary (alert when != 1)", registry=r)
        self.standby_ready = Gauge("understudy_standby_ready", "READY standby engines", registry=r)
        self.router_requests = Counter("understudy_router_requests", "Data-plane responses by status code",
                                       ["code"], registry=r)
        self.router_retries = Counter("understudy_router_retries", "Requests retried on another primary", registry=r)
        self.router_hold = Histogram("understudy_router_hold_seconds", "Time requests waited for a primary",
                                     buckets=_FAST, registry=r)
        self.router_first_token = Histogram(
            "understudy_router_first_token_seconds", "Request received by the router -> its first token back "
            "from the engine (continuable requests, before any continuation)", buckets=FIRST_OUTPUT_BUCKETS, registry=r)
        self.migrations = Counter("understudy_migrations", "Requests whose primary was lost mid-request, by "
                                  "result (continued, failed, quarantined, unsupported, limit)", ["result"], registry=r)
        self.migration_stall = Histogram("understudy_migration_stall_seconds", "Gap a client sees in its "
                                         "response across a continuation", buckets=_FAST, registry=r)
        self.gc_pause = Histogram("understudy_supervisor_gc_pause_seconds", "Garbage collections of the "
                                  "supervisor's process, by generation: each stops the router (every stream) "
                                  "while it runs", ["generation"], buckets=GC_BUCKETS, registry=r)
        for generation in "012":  # (each series shows from the start, at 0)
            self.gc_pause.labels(generation=generation)
        self.daemon_resident = Gauge("understudy_daemon_resident_bytes", "Bytes held by each rank's daemon",
                                     ["rank"], registry=r)
        self.daemon_state = Gauge("understudy_daemon_state", "1 for the current state of each weight cache daemon "
                                  "(ours, or an external engine's)", ["daemon", "state"], registry=r)
        self.daemon_starts = Counter("understudy_daemon_starts", "Starts of each weight cache daemon (the first, "
                                     "then its restarts)", ["daemon"], registry=r)
        self.engine_state = Gauge("understudy_engine_state", "1 for the current state of each engine slot",
                                  ["engine", "state"], registry=r)
        self.epoch = Gauge("understudy_epoch", "Primary epoch", registry=r)
        self.fatal_retries = Counter("understudy_fatal_retries", "Slow retries of FATAL engine slots "
                                     "(failover.fatal_retry_s)", ["engine"], registry=r)
        serving = "engine's serving figures, from its heartbeats"
        self.engine_figures = {field: Gauge(f"understudy_engine_{key}", f"{help_} ({serving})", ["engine"], registry=r)
                               for key, field, help_ in ENGINE_FIGURES}
        self.prefix_queried = Counter("understudy_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the engines' prefix caches", registry=r)
        self.prefix_hit = Counter("understudy_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the engines' prefix caches", registry=r)
        self.generated_tokens = Counter("understudy_generated_tokens", "Tokens the engines generated "
                                        "(output tokens, from their heartbeats)", registry=r)
        self.kv_checked = Counter("understudy_kv_checked_blocks", "Shared KV blocks checked against their "
                                  "digests before reuse (engines/kv/integrity.py)", registry=r)
        self.kv_corrupt = Counter("understudy_kv_corrupt_blocks", "Shared KV blocks whose bytes changed since "
                                  "they were sealed: dropped and recomputed instead of reused", registry=r)
        self.step_seconds = Histogram(
            "understudy_engine_step_seconds", "A busy engine's mean scheduler step over one heartbeat interval: "
            "the time between two tokens of each of its decoding streams, at the engine", buckets=FIRST_OUTPUT_BUCKETS,
            registry=r)
        self.continuation_recomputed = Histogram(
            "understudy_continuation_recomputed_tokens", "Tokens a continued request computed again on its new "
            "engine (the rest it found in the shared KV pool)", buckets=RECOMPUTED_BUCKETS, registry=r)
        self.kv_adopted_blocks = Gauge("understudy_kv_adopted_blocks", "Keyed KV blocks the last promoted engine "
                                       "adopted from the shared pool", registry=r)
        self.kv_promotion_seconds = Histogram("understudy_kv_promotion_seconds", "A standby taking the shared KV "
                                              "pool over (claim and adoption, in the engine)", buckets=_FAST,
                                              registry=r)
        self._beat_at: dict[str, float] = {}  # engine -> when its previous heartbeat came (monotonic)

    def count_weights_source(self, source: str) -> None:
        """cache_hit -> hit; disk:<reason> -> miss with that reason."""
        if source == "cache_hit":
            self.weight_cache.labels(result="hit", reason="").inc()
        elif source.startswith("disk:"):
            self.weight_cache.labels(result="miss", reason=source[5:][:120]).inc()

    def set_engine_state(self, engine: str, state: str, all_states: list[str]) -> None:
        for s in all_states:
            self.engine_state.labels(engine=engine, state=s).set(1 if s == state else 0)

    def record_heartbeat(self, engine: str, hb: dict, previous: dict, now: float | None = None) -> None:
        """An engine's serving figures; its cumulative token counts add their growth since its
        previous heartbeat (a new incarnation starts from zero), and an interval it was busy
        throughout gives its mean step time (``now``: when ``hb`` came, monotonic; default: now)."""
        for field, gauge in self.engine_figures.items():
            if isinstance(hb.get(field), (int, float)):
                gauge.labels(engine=engine).set(hb[field])
        for counter, field in ((self.prefix_queried, "prefix_queried_tokens"), (self.prefix_hit, "prefix_hit_tokens"),
                               (self.generated_tokens, "generated_tokens"), (self.kv_checked, "kv_checked_blocks"),
                               (self.kv_corrupt, "kv_corrupt_blocks")):
            count, before = hb.get(field), previous.get(field) or 0
            if isinstance(count, int):
                counter.inc(count - before if count >= before else count)
        t, t_before = time.monotonic() if now is None else now, self._beat_at.get(engine)
        self._beat_at[engine] = t
        steps, steps_before = hb.get("steps"), previous.get("steps")
        if (t_before is not None and hb.get("running") and previous.get("running") and isinstance(steps, int)
                and isinstance(steps_before, int) and steps > steps_before):
            self.step_seconds.observe((t - t_before) / (steps - steps_before))

    def observe_gc(self, generation: int, seconds: float) -> None:
        """A collection's pause (wire/gc_pauses.py `GcPauses.observers`)."""
        self.gc_pause.labels(generation=str(generation)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
