"""configs/vllm.yaml and configs/sglang.yaml, as written, run against stand-ins with the same command line
(`vllm serve MODEL --host --port ...`, `python3 -m sglang.launch_server --model-path ... --port ...`: each
parses its flags as the real one names them and refuses any other, then serves the model of
tests/openai_stand_in.py with what that server takes: vLLM token ids and continue_final_message, SGLang the
latter). Neither real server ran here (no GPU): what this checks is the recipes' shape, the model id read from
/v1/models and the continuation path each gets across a SIGKILL of the primary."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from harness import ROOT
from harness.node import Harness

from openai_stand_in import STAND_IN, chat_prompt, kill_mid_stream, next_text

VLLM = '''#!{python}
"""A stand-in for `vllm serve` (its flags as vLLM's documentation names them)."""
import argparse, os, sys
p = argparse.ArgumentParser(prog="vllm")
serve = p.add_subparsers(dest="command", required=True).add_parser("serve")
serve.add_argument("model")
serve.add_argument("--host", required=True)
serve.add_argument("--port", type=int, required=True)
serve.add_argument("--gpu-memory-utilization", type=float, required=True)
serve.add_argument("--tensor-parallel-size", type=int, default=1)
a = p.parse_args()
assert os.environ.get("CUDA_VISIBLE_DEVICES") == "0", "the recipe's env reaches the engine"
os.execv(sys.executable, [sys.executable, "{stand_in}", str(a.port), str(a.port), "ids", "id:" + a.model, "0.03",
                          "{log}"])
'''
SGLANG = '''#!{python}
"""`python3` for the engine's command: a stand-in for `-m sglang.launch_server` (its flags as SGLang's
documentation names them); anything else runs the real interpreter."""
import argparse, os, sys
if sys.argv[1:3] != ["-m", "sglang.launch_server"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
p.add_argument("--model-path", required=True)
p.add_argument("--host", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--mem-fraction-static", type=float, required=True)
p.add_argument("--tp", type=int, default=1)
a = p.parse_args(sys.argv[3:])
os.execv(sys.executable, [sys.executable, "{stand_in}", str(a.port), str(a.port), "chat", "id:" + a.model_path, "0.03",
                          "{log}"])
'''
N = 48


@pytest.mark.parametrize("recipe, fake, name, paths", [
    ("vllm.yaml", VLLM, "vllm", "completions: exact (token ids), chat: replay by text"),
    ("sglang.yaml", SGLANG, "python3", "completions: replay by text, chat: replay by text"),
])
def test_recipe_serves_and_continues_streams(tmp_path, recipe, fake, name, paths):
    cfg = yaml.safe_load((ROOT / "configs" / recipe).read_text())
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    cfg.update(runtime_dir=str(tmp_path / "rt"), router={"port": 0}, admin={"port": 0})
    cfg["model"]["path"] = str(model)
    cfg["failover"].update(startup_timeout_s=60, probe_interval_s=0.3)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    exe = bin_dir / name
    exe.write_text(fake.format(python=sys.executable, stand_in=tmp_path / "stand_in.py", log=tmp_path / "asked"))
    exe.chmod(0o755)
    h = Harness(tmp_path, yaml.safe_dump(cfg), env={"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        assert f"model id {str(model)!r}; continuation: {paths}" in h.tail(200), h.tail(40)
        chat = [{"role": "user", "content": "Tell me a story"}]
        bodies = [{"model": "qwen", "prompt": p, "max_tokens": N, "stream": True} for p in ("Once upon", "Hello")]
        bodies.append({"model": "qwen", "messages": chat, "max_tokens": N, "stream": True})
        streams, _ = kill_mid_stream(h, bodies)
        for s, b in zip(streams, bodies):
            assert s.whole and s.text == next_text(b.get("prompt") or chat_prompt(chat), N), (s.error, s.text)
    finally:
        assert h.stop() == 0, h.tail()
