"""The engine's own `GET /metrics`: its serving figures in Prometheus text format."""
from __future__ import annotations

# stats() key -> (metric name, type, help)
FIGURES = {
    "running": ("understudy_engine_running_seqs", "gauge", "Sequences running"),
    "waiting": ("understudy_engine_waiting_seqs", "gauge", "Sequences waiting"),
    "kv_blocks_used": ("understudy_engine_kv_blocks_used", "gauge", "KV cache blocks in use"),
    "kv_blocks_total": ("understudy_engine_kv_blocks_total", "gauge", "KV cache blocks"),
    "preemptions": ("understudy_engine_preemptions_total", "counter", "Sequences preempted (recomputed later)"),
    "served": ("understudy_engine_served_total", "counter", "Sequences finished"),
    "steps": ("understudy_engine_steps_total", "counter", "Scheduler steps"),
    "prefix_queried_tokens": ("understudy_prefix_cache_queried_tokens_total", "counter",
                              "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": ("understudy_prefix_cache_hit_tokens_total", "counter",
                          "Prompt tokens found in the prefix cache"),
    "cuda_graphs_pending": ("understudy_engine_cuda_graphs_pending", "gauge",
                            "CUDA graphs left to capture after ready (captured when the engine has time)"),
}


def render(stats: dict) -> str:
    lines = []
    for key, (name, kind, help_) in FIGURES.items():
        if key in stats:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    return "\n".join(lines) + "\n"
