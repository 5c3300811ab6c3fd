"""`understudy bench restart`: restart-to-ready in `client` mode (a daemon holds the weights), by a
cold `python -m engines` and by the spawn server; ready = a greedy completion answered over HTTP;
then until the engine has captured the CUDA graphs it left for after ready. Per-phase seconds from
the engine's /startup."""
from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from wire.engine_config import EngineConfig
from models import read_model_args
from engines.process.spawn_client import SpawnClient
from engines.process.startup import PHASES
from harness import ROOT
from harness.engine_process import EngineProcess, first_completion, wait_for_ready_line


def _ready_by_canary(url: str, model: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            first_completion(url, model)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _one_restart(cfg: EngineConfig, log: Path, spawn) -> dict:  # noqa: ANN001
    """Start an engine (cold, or through `spawn`), time until a canary completion succeeds, kill it."""
    t0 = time.perf_counter()
    if spawn is None:
        proc = EngineProcess(cfg, log)
        pid, exited = proc.pid, proc.proc.poll
    else:
        pid = spawn.spawn(cfg, str(log))
        exited = lambda: spawn.wait(pid)  # noqa: E731
    try:
        ready = wait_for_ready_line(log, 300, exited)
        url = f"http://{cfg.host}:{ready['port']}"
        _ready_by_canary(url, cfg.served_model_name or Path(cfg.model_path).name, 60)
        total = time.perf_counter() - t0
        startup = httpx.get(url + "/startup").json()
        while httpx.get(url + "/health").json().get("cuda_graphs_pending") and time.perf_counter() - t0 < 120:
            time.sleep(0.01)  # (the graphs an engine captures after ready: EngineConfig.cuda_graphs_before_ready)
        all_graphs = time.perf_counter() - t0
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if spawn is None:
            proc.proc.wait()
        else:
            while spawn.wait(pid) is None:
                time.sleep(0.01)
    return {"ready_s": total, "all_graphs_s": all_graphs, **startup}


def _wait_for_path(path: Path, log: Path, timeout_s: float = 120) -> None:
    """Wait until a server's socket exists (it binds after its imports)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s:.0f} s; see {log}")
        time.sleep(0.05)


def bench_restart(model_dir: str, device: str, dtype: str | None, runs: int, kv_cache_bytes: int,
                  max_num_seqs: int, work_dir: Path | None = None) -> dict:
    """Median restart-to-ready, cold exec vs spawn server; logs stay in `work_dir` (default: a temp
    dir removed on success)."""
    from daemon.runtime_dir import daemon_socket_path, ensure_private_dir

    model_dir = str(Path(model_dir).resolve())
    dtype = dtype or ("float32" if device == "cpu" else read_model_args(model_dir).torch_dtype)
    work = Path(work_dir or tempfile.mkdtemp(prefix="understudy-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rt = ensure_private_dir(work / "rt")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> subprocess.Popen:
        with open(work / log, "wb") as f:
            p = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=ROOT)
        procs.append(p)
        return p

    def cfg(name: str) -> EngineConfig:
        return EngineConfig(name=name, model_path=model_dir, port=0, runtime_dir=str(rt), device=device,
                            gpu_ids=[0] if device == "cuda" else [], dtype=dtype, weight_cache_mode="client",
                            kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs)
    results: dict[str, list[dict]] = {"cold": [], "spawn": []}
    try:
        start(["-m", "daemon", "--model", model_dir, "--rank", "0", "--device", device, "--dtype", dtype,
               "--runtime-dir", str(rt)], "daemon.log")
        start(["-m", "engines.process.spawn_server", "--socket", str(work / "spawn.sock"), "--tokenizer", model_dir],
              "spawn-server.log")  # (as the supervisor starts it)
        _wait_for_path(daemon_socket_path(rt, 0), work / "daemon.log")
        _wait_for_path(work / "spawn.sock", work / "spawn-server.log")
        # The first engine waits for the daemon's cold load; it is not timed.
        warm = _one_restart(cfg("warmup"), work / "warmup.log", None)
        if warm["weights_source"] != "cache_hit":
            raise RuntimeError(f"warm-up engine loaded {warm['weights_source']}, not cache_hit; see {work}")
        with SpawnClient(str(work / "spawn.sock")) as spawn:
            for i in range(runs):
                results["cold"].append(_one_restart(cfg(f"cold{i}"), work / f"cold{i}.log", None))
                results["spawn"].append(_one_restart(cfg(f"spawn{i}"), work / f"spawn{i}.log", spawn))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for mode, rs in results.items():
        summary[mode] = {"ready_s": statistics.median(r["ready_s"] for r in rs),
                         "all_graphs_s": statistics.median(r["all_graphs_s"] for r in rs),
                         "phases": {p: statistics.median(r["phases"][p] for r in rs) for p in PHASES},
                         "weights_source": sorted({r["weights_source"] for r in rs})}
    return {"device": device, "dtype": dtype, "runs": runs, "modes": summary}


def print_restart(r: dict) -> None:
    print(f"\nrestart to ready (client mode, median of {r['runs']}, {r['device']} {r['dtype']}):")
    head = "".join(f"{p:>14}" for p in PHASES)
    print(f"{'mode':<8}{'ready_s':>9}{head}  {'all graphs s':>12}  source")
    for mode, s in r["modes"].items():
        cells = "".join(f"{s['phases'][p]:>14.3f}" for p in PHASES)
        print(f"{mode:<8}{s['ready_s']:>9.3f}{cells}  {s['all_graphs_s']:>12.3f}  {','.join(s['weights_source'])}")
    print("(all graphs s: until the engine had captured the CUDA graphs it leaves for after ready; ready_s "
          "with `engines.cuda_graphs_before_ready: all`: the two together)")


# ---- validate (H200) --------------------------------------------------------------------------