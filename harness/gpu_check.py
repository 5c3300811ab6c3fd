"""`python -m harness.gpu_check`: validate the `cuda` transport and run the benchmarks on a GPU host.

Checks, with real processes: a cuda daemon fills its arena; two clients attach and read the same
bytes as a disk load; GPU memory grows by the arena once, not per client (nvidia-smi); a client's
write through its read-only mapping is refused and does not land; the clients keep reading after
the daemon is SIGKILLed. Then `bench attach` (8 GB and 40 GB, 10,000 tensors) and `bench load`.
Prints a table; exit code 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT


CLIENT_SCRIPT = r"""
import hashlib, json, sys, torch
from daemon.client import attach_or_load
from daemon.fingerprint import make_cache_config
from models import build_model, read_model_args, torch_dtype
model_dir, runtime_dir, mode, device, dtype = sys.argv[1:6]
torch.cuda.set_device(torch.device(device)) if device.startswith("cuda") else None
model = build_model(read_model_args(model_dir), dtype=torch_dtype(dtype), device="meta")
res = attach_or_load(model, make_cache_config(model_dir, dtype=dtype, device=device), mode, runtime_dir, 0, device)
def digest():
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
print(json.dumps({"source": res.source, "digest": digest(), "timings": res.timings}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "read":
        print(json.dumps({"digest": digest()}), flush=True)
    elif cmd == "write":
        try:
            model.lm_head.weight.add_(1.0)
            torch.cuda.synchronize()
            print(json.dumps({"write": "allowed"}), flush=True)
        except Exception as e:
            print(json.dumps({"write": "refused: " + str(e).splitlines()[0][:120]}), flush=True)
    else:
        break
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def gpu_memory_mib(gpu: int) -> int | None:
    """Used memory of one GPU according to nvidia-smi (None if nvidia-smi is missing)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", str(gpu)], capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class Client:
    """A client engine process holding its weights; answers `read` / `write` on stdin."""

    def __init__(self, model: Path, rt: Path, mode: str, device: str, dtype: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, str(model), str(rt), mode, device, dtype],
                                     cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client ({mode}) died: {self.proc.stderr.read()[-2000:]}")
        self.first = json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"died": self.proc.wait(timeout=60)}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _status(rt: Path) -> dict:
    from daemon.framing import recv_frame, send_frame

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(rt / "daemon-rank0.sock"))
        send_frame(s, {"op": "status"})
        return recv_frame(s)[0]["daemon"]


def run_checks(model: Path, gpu: int = 0, dtype: str | None = None, transport: str = "cuda") -> list[tuple[str, bool, str]]:
    """The transport checks on one GPU (or `transport="cpu"`: a dry run); rows of (check, passed, detail)."""
    dtype = dtype or json.loads((model / "config.json").read_text()).get("torch_dtype", "float32")
    device = f"cuda:{gpu}" if transport == "cuda" else "cpu"
    rows: list[tuple[str, bool, str]] = []
    rt = Path(tempfile.mkdtemp(prefix="understudy-gpu-")) / "rt"  # kept (with daemon.log) if a check fails
    log = open(rt.parent / "daemon.log", "wb")
    mem0 = gpu_memory_mib(gpu)
    daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--model", str(model), "--device", transport,
                               "--gpu-id", str(gpu), "--dtype", dtype, "--runtime-dir", str(rt)],
                              cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    clients: list[Client] = []
    try:
        deadline = time.monotonic() + 600
        info: dict = {}
        while time.monotonic() < deadline and daemon.poll() is None:
            try:
                info = _status(rt)
                if info["state"] == "ready":
                    break
            except OSError:
                pass
            time.sleep(0.2)
        ok = info.get("state") == "ready"
        rows.append((f"daemon fills a {transport} arena", ok,
                     f"{info.get('resident_bytes', 0) / 1e9:.2f} GB, {info.get('tensors')} tensors, "
                     f"{info.get('load_seconds') or 0:.2f} s, {info.get('progress', {}).get('gbps', 0):.2f} GB/s"
                     if ok else (rt.parent / "daemon.log").read_text()[-500:]))
        if not ok:
            return rows
        mem1 = gpu_memory_mib(gpu)
        reference = Client(model, rt.parent / "nothing", "off", device, dtype)
        expected = reference.first["digest"]
        reference.close()
        time.sleep(1.0)
        mem_before_clients = gpu_memory_mib(gpu)
        a, b = Client(model, rt, "client", device, dtype), Client(model, rt, "client", device, dtype)
        clients += [a, b]
        same = a.first["digest"] == b.first["digest"] == expected
        rows.append(("two clients attach, read the disk bytes", same and a.first["source"] == "cache_hit" == b.first["source"],
                     f"sources {a.first['source']}, {b.first['source']}; attach "
                     f"{a.first['timings'].get('total_s', 0) * 1e3:.1f} ms"))
        mem2 = gpu_memory_mib(gpu)
        if transport == "cpu":
            pass
        elif None not in (mem0, mem1, mem2, mem_before_clients):
            arena_mib = info["resident_bytes"] / 2**20
            per_client = (mem2 - mem_before_clients) / 2
            rows.append(("memory counted once (nvidia-smi)", per_client < 0.5 * arena_mib,
                         f"daemon +{mem1 - mem0} MiB for a {arena_mib:.0f} MiB arena; each client +{per_client:.0f} MiB"))
        else:
            rows.append(("memory counted once (nvidia-smi)", False, "nvidia-smi not available"))
        writer = Client(model, rt, "client", device, dtype)
        clients.append(writer)
        outcome = writer.ask("write")
        after = a.ask("read")["digest"]
        rows.append(("client write refused, does not land", outcome.get("write") != "allowed" and after == expected,
                     f"{outcome}; other client's bytes {'unchanged' if after == expected else 'CHANGED'}"))
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        time.sleep(1.0)
        reads = [c.ask("read").get("digest") for c in (a, b)]
        rows.append(("mapping outlives SIGKILLed daemon", reads == [expected, expected],
                     f"both clients read {'the same bytes' if reads == [expected, expected] else reads}"))
    finally:
        for c in clients:
            c.close()
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()
        if rows and all(ok for _, ok, _ in rows):
            shutil.rmtree(rt.parent, ignore_errors=True)
    return rows


def _bench(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "harness.bench.weights", *argv, "--json"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (default: make-model --preset 1b in a temp dir)")
    p.add_argument("--gpu-id", type=int, default=0)
    p.add_argument("--transport", choices=["cuda", "cpu"], default="cuda", help="cpu: dry run without a GPU")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--json", help="also write every result to this JSON file")
    args = p.parse_args(argv)
    made = None
    if args.model:
        model = Path(args.model)
    else:
        from models.make_model import make_model

        made = Path(tempfile.mkdtemp(prefix="understudy-1b-"))
        model = make_model(made / "1b", "1b", "llama", seed=0)
    try:
        return _run(args, model)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _run(args, model: Path) -> int:
    rows = run_checks(model, args.gpu_id, transport=args.transport)
    benches: dict = {}
    if not args.skip_bench:
        gpu = ["--gpu-id", str(args.gpu_id)] if args.transport == "cuda" else []
        for gb in ((8, 40) if args.transport == "cuda" else (1,)):
            benches[f"attach_10k_{gb}GB"] = _bench(["attach", "--tensors", "10000", "--total-mb", str(gb * 1000),
                                                    "--device", args.transport, *gpu, "--repeat", "3"])
        benches[f"load_{args.transport}"] = _bench(["load", str(model), "--device", args.transport, *gpu])
        if args.transport == "cuda":
            benches["load_cpu"] = _bench(["load", str(model), "--device", "cpu"])
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  result  detail")
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {detail}")
    for name, res in benches.items():
        keys = [k for k in res if k.endswith(("_ms", "_gbps", "_over_arena", "_vs_raw_read", "_vs_safetensors"))
                or k in ("error", "gb", "total_mb")]
        print(f"{name}: " + ", ".join(f"{k}={res[k]:.3f}" if isinstance(res[k], float) else f"{k}={res[k]}"
                                      for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": rows, "bench": benches, "model": str(model)}, indent=1))
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
