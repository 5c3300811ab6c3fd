"""The shared KV pool on one GPU, engine by engine (no supervisor): a daemon holds the weights and the
pool, engine a and engine b map both; the probe plays the supervisor on the control channel.

Prints: GPU memory per process with both engines parked; a's promotion; then, with STREAMS streams in
flight on a, SIGKILL of a, b's promotion (adopted / quarantined blocks, its own time), and for every
stream the continuation on b (first-chunk latency, tokens reused and recomputed).

    python bench/probes/shared_kv_engine.py MODEL_DIR [--streams 64] [--pool-gib 32] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import zmq

from daemon import framing
from daemon.runtime_dir import daemon_socket_path, ensure_private_dir
from engines.config import EngineConfig
from harness.engine_process import EngineProcess


class Control:
    """The supervisor's end of the control channel."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.msgs: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.lock = threading.Lock()

    def _pump(self) -> None:
        while True:
            _, raw = self.sock.recv_multipart()
            self.msgs.append(json.loads(raw))

    def ask(self, engine: EngineProcess, cmd: str, reply: str, timeout: float = 30) -> tuple[dict, float]:
        start = len(self.msgs)
        t0 = time.perf_counter()
        self.sock.send_multipart([f"{engine.cfg.name}:1".encode(), json.dumps({"cmd": cmd}).encode()])
        while time.perf_counter() - t0 < timeout:
            for m in self.msgs[start:]:
                if m["engine"] == engine.cfg.name and m["type"] in (reply, f"{cmd}_failed"):
                    return m, time.perf_counter() - t0
            time.sleep(0.0002)
        raise TimeoutError(f"{engine.cfg.name}: no {reply}")


def gpu_memory() -> str:
    return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--pool-gib", type=float, default=32)
    p.add_argument("--out", default="/tmp/shared_kv_probe")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rt = ensure_private_dir(out / "rt")
    daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--model", a.model, "--device", "cuda", "--dtype",
                               "bfloat16", "--runtime-dir", str(rt), "--kv-pool-bytes", str(int(a.pool_gib * 2**30)),
                               "--kv-slots", "2"], stdout=open(out / "daemon.log", "w"), stderr=subprocess.STDOUT)
    while True:
        try:
            if framing.request(daemon_socket_path(rt, 0), {"op": "status"}, 5)["daemon"]["state"] == "ready":
                break
        except OSError:
            pass
        time.sleep(0.2)
    control = Control(f"ipc://{out}/control.sock")
    engines = []
    for slot, name in enumerate("ab"):
        cfg = EngineConfig(name=name, model_path=a.model, port=0, runtime_dir=str(rt), device="cuda", gpu_ids=[0],
                           dtype="bfloat16", weight_cache_mode="client", shared_kv=True, kv_slot=slot,
                           control_endpoint=control.sock.getsockopt_string(zmq.LAST_ENDPOINT), incarnation=1,
                           max_num_seqs=256, max_model_len=2048)
        engines.append(EngineProcess(cfg, out / f"{name}.log"))
    for e in engines:
        e.wait_ready(300)
    eng_a, eng_b = engines
    print("pids: daemon", daemon.pid, "a", eng_a.pid, "b", eng_b.pid)
    print("GPU memory, both parked (pid, MiB):\n" + gpu_memory())
    promoted, secs = control.ask(eng_a, "promote", "promoted")
    print(f"a promoted in {secs * 1e3:.1f} ms round trip: {promoted}")
    name = os.path.basename(a.model)
    results: list[dict] = [{} for _ in range(a.streams)]

    def stream(i: int) -> None:
        prompt = [(i * 7919 + k * 31) % 30000 + 100 for k in range(300 + (i * 37) % 500)]
        body = {"model": name, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True, "stream": True}
        ids: list[int] = []
        try:
            with httpx.stream("POST", eng_a.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        except httpx.HTTPError:
            pass
        results[i] = {"body": body, "prompt": prompt, "ids": ids}

    with ThreadPoolExecutor(a.streams) as pool:
        futs = [pool.submit(stream, i) for i in range(a.streams)]
        time.sleep(2.0)
        t_kill = time.perf_counter()
        os.killpg(eng_a.pid, signal.SIGKILL)
        promoted, secs = control.ask(eng_b, "promote", "promoted")
        for f in futs:
            f.result()
    print(f"b promoted {1e3 * (time.perf_counter() - t_kill):.1f} ms after the kill ({secs * 1e3:.1f} ms round trip): "
          f"{promoted}")

    def cont(r: dict) -> float:
        body = {**r["body"], "continuation": {"prompt_token_ids": r["prompt"], "output_token_ids": r["ids"]}}
        t0 = time.perf_counter()
        with httpx.stream("POST", eng_b.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                    return time.perf_counter() - t0
        return float("nan")

    live = [r for r in results if r.get("ids") and len(r["ids"]) < 1000]
    mark = len(control.msgs)
    with ThreadPoolExecutor(len(live) or 1) as pool:
        firsts = sorted(pool.map(cont, live))
    time.sleep(0.5)
    conts = [m for m in control.msgs[mark:] if m["type"] == "continuation"]
    recomputed = [m["recomputed"] for m in conts]
    print(f"streams cut by the kill: {len(live)} of {a.streams}; continuations reported: {len(conts)}")
    if firsts:
        print(f"continuation first token: median {statistics.median(firsts) * 1e3:.1f} ms, max {firsts[-1] * 1e3:.1f} ms "
              f"(all {len(firsts)} at once)")
    if recomputed:
        print(f"tokens recomputed per continuation: max {max(recomputed)}, median {statistics.median(recomputed)}; "
              f"reused median {statistics.median(m['reused'] for m in conts)}")
    print("GPU memory after (pid, MiB):\n" + gpu_memory())
    for e in engines:
        try:
            os.killpg(e.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    daemon.terminate()


if __name__ == "__main__":
    main()
