"""configs/vllm.yaml and configs/sglang.yaml, as written, run against stand-ins with the same command lines
(tests/recipe_stand_ins.py: `vllm preload ...` then `vllm serve MODEL ... --load-format ipc_cache`,
`python3 -m sglang.srt.weight_cache.daemon ...` then `python3 -m sglang.launch_server ... --weight-cache-mode
client`). Neither real server ran here (no GPU): what this checks is the recipes' shape, their daemon READY
before the engines, the model id read from /v1/models and the continuation path each gets across a SIGKILL of
the primary. The daemon's own SIGKILL: tests/supervisor/external/test_external_daemons.py."""
from __future__ import annotations

import pytest
import yaml

from harness.node import Harness

from openai_stand_in import chat_prompt, kill_mid_stream, next_text
from recipe_stand_ins import install

N = 48


@pytest.mark.parametrize("recipe, paths", [
    ("vllm.yaml", "completions: exact (token ids), chat: replay by text"),
    ("sglang.yaml", "completions: replay by text, chat: replay by text"),
])
def test_recipe_serves_and_continues_streams(tmp_path, recipe, paths):
    cfg, env = install(tmp_path, recipe)
    model = cfg["model"]["path"]
    h = Harness(tmp_path, yaml.safe_dump(cfg), env=env)
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        assert f"model id {model!r}; continuation: {paths}" in h.tail(200), h.tail(40)
        assert "weights mapped from" in (h.rd / "logs" / "a-1.log").read_text()  # (its daemon was READY)
        assert h.status()["daemons"][0]["state"] == "READY"
        chat = [{"role": "user", "content": "Tell me a story"}]
        bodies = [{"model": "qwen", "prompt": p, "max_tokens": N, "stream": True} for p in ("Once upon", "Hello")]
        bodies.append({"model": "qwen", "messages": chat, "max_tokens": N, "stream": True})
        streams, _ = kill_mid_stream(h, bodies)
        for s, b in zip(streams, bodies):
            assert s.whole and s.text == next_text(b.get("prompt") or chat_prompt(chat), N), (s.error, s.text)
    finally:
        assert h.stop() == 0, h.tail()
