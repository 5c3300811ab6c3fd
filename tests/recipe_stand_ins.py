"""The programs configs/vllm.yaml and configs/sglang.yaml run, as stand-ins with the same command lines,
installed on a PATH of their own: `vllm serve ...` and `vllm preload ...`; `python3 -m sglang.launch_server
...` and `python3 -m sglang.srt.weight_cache.daemon ...`. Each parses its flags as the real one names them
and refuses any other; the daemons are tests/daemon_stand_in.py, the engines serve the model of
tests/openai_stand_in.py (vLLM: token ids and continue_final_message, SGLang the latter). An engine told to
load from its daemon (vLLM `--load-format ipc_cache`, SGLang `--weight-cache-mode client`) refuses to start
unless the daemon accepts connections (the real ones fall back to a disk load, or raise): a start before
the daemon is READY fails the test."""
from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from harness import ROOT

from openai_stand_in import STAND_IN

TESTS = Path(__file__).resolve().parent
VLLM = '''#!{python}
"""A stand-in for `vllm serve` and `vllm preload` (their flags as vLLM's documentation names them)."""
import argparse, json, os, sys
sys.path.insert(0, "{tests}")
from daemon_stand_in import daemon_up, main as daemon_main, vllm_socket
if sys.argv[1:2] == ["preload"]:
    daemon_main(["vllm", *sys.argv[1:]])
p = argparse.ArgumentParser(prog="vllm")
serve = p.add_subparsers(dest="command", required=True).add_parser("serve")
serve.add_argument("model")
serve.add_argument("--host", required=True)
serve.add_argument("--port", type=int, required=True)
serve.add_argument("--gpu-memory-utilization", type=float, required=True)
serve.add_argument("--tensor-parallel-size", type=int, default=1)
serve.add_argument("--load-format", default="auto")
serve.add_argument("--model-loader-extra-config", type=json.loads, default=dict())
a = p.parse_args()
assert os.environ.get("CUDA_VISIBLE_DEVICES") == "0", "the recipe's env reaches the engine"
if a.load_format == "ipc_cache":
    sock = vllm_socket(a.model_loader_extra_config["socket_dir"])
    if not daemon_up(sock):
        sys.exit("vllm stand-in: no weight cache daemon at %s" % sock)
    print("vllm stand-in: weights mapped from %s" % sock, flush=True)
os.execv(sys.executable, [sys.executable, "{stand_in}", str(a.port), str(a.port), "ids", "id:" + a.model, "0.03",
                          "{log}"])
'''
SGLANG = '''#!{python}
"""`python3` for the engine's and the daemon's commands: a stand-in for `-m sglang.launch_server` and
`-m sglang.srt.weight_cache.daemon` (their flags as SGLang's documentation names them); anything else
runs the real interpreter."""
import argparse, os, sys
sys.path.insert(0, "{tests}")
from daemon_stand_in import daemon_up, main as daemon_main, sglang_socket
if sys.argv[1:3] == ["-m", "sglang.srt.weight_cache.daemon"]:
    daemon_main(["sglang", *sys.argv[1:]])
if sys.argv[1:3] != ["-m", "sglang.launch_server"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
p.add_argument("--model-path", required=True)
p.add_argument("--host", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--mem-fraction-static", type=float, required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--weight-cache-mode", choices=["off", "daemon", "client"], default="off")
a = p.parse_args(sys.argv[3:])
if a.weight_cache_mode == "client":
    if not daemon_up(sglang_socket(0)):
        sys.exit("sglang stand-in: no weight cache daemon at %s" % sglang_socket(0))
    print("sglang stand-in: weights mapped from %s" % sglang_socket(0), flush=True)
os.execv(sys.executable, [sys.executable, "{stand_in}", str(a.port), str(a.port), "chat", "id:" + a.model_path, "0.03",
                          "{log}"])
'''
PROGRAMS = {"vllm.yaml": (VLLM, "vllm"), "sglang.yaml": (SGLANG, "python3")}


def short_dir() -> str:
    """A runtime dir under /tmp with a short name (a Unix socket's path is at most 107 bytes: vLLM's socket
    under a pytest tmp_path is longer), removed when the tests end."""
    rt = tempfile.mkdtemp(prefix="us-")
    atexit.register(shutil.rmtree, rt, True)
    return rt


def install(tmp_path: Path, recipe: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe as written, with a model folder under ``tmp_path``, a runtime dir and free ports; and the
    environment whose PATH runs the stand-ins (SGLang's daemon sockets under ``tmp_path`` too)."""
    cfg = yaml.safe_load((ROOT / "configs" / recipe).read_text())
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    cfg.update(runtime_dir=short_dir(), router={"port": 0}, admin={"port": 0})
    cfg["model"]["path"] = str(model)
    cfg["failover"].update(startup_timeout_s=60, probe_interval_s=0.3)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    text, name = PROGRAMS[recipe]
    exe = bin_dir / name
    exe.write_text(text.format(python=sys.executable, stand_in=tmp_path / "stand_in.py", log=tmp_path / "asked",
                               tests=TESTS))
    exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(tmp_path / "sglang-wc" / "{device_uuid}.sock")}
    return cfg, env
