"""A deterministic node (real supervisor, two engines on the shared KV pool, tiny model in
bfloat16 on CPU) through `understudy bench determinism`: every reply under concurrent load, and
across SIGKILLs of the primary (streams continued on the standby), is its solo text; /status says
the node and its engines are deterministic."""
from __future__ import annotations

import argparse

from harness.bench.determinism import run

CONFIG = """
model: {{path: {model}, dtype: bfloat16}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 256,
          max_num_batched_tokens: 64, kv_block_size: 8}}
failover: {{heartbeat_timeout_s: 1.5, probe_interval_s: 0.5, probe_timeout_s: 5, hold_timeout_s: 20,
           backoff_base_s: 0.1, backoff_max_s: 1, drain_timeout_s: 10, stop_timeout_s: 5}}
"""


def test_replies_are_the_solo_text_under_load_and_across_kills(tmp_path, tiny_model):
    cfg = tmp_path / "node.yaml"
    cfg.write_text(CONFIG.format(model=tiny_model))
    args = argparse.Namespace(config=str(cfg), preset=None, model=None, device=None, prompts=3, max_tokens=12, max_words=30,
                              clients=3, duration=6.0, kills=2, no_stream=False, default_mode=False, dtype=None,
                              boot_timeout=120.0, json=True)
    res = run(args)
    assert res["dtype"] == "bfloat16" and res["node_says"] is True
    assert res["engines_say"] == {"a": True, "b": True}
    for name, phase in res["phases"].items():
        assert phase["replies"] > 0 and phase["failed"] == 0, (name, phase)
        assert phase["identical"] == phase["replies"], (name, phase["mismatches"])
    assert res["phases"]["kills"]["kills"] == 2 and res["phases"]["kills"]["continued"] > 0  # (streams did span the kills)
