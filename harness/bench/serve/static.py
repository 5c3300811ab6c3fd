"""The engine's static decode figure for the same run: `python -m harness.bench.engine decode` in a
subprocess (after the live sweep, so the two do not compete), same checkpoint, device, dtype,
max_model_len and kernels as the server."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import ROOT

from .target import Target


def static_batches(concurrency: list[int], max_num_seqs: int | None) -> dict[int, int]:
    """The decode batch each live concurrency runs at: the concurrency, capped by max_num_seqs."""
    return {c: min(c, max_num_seqs) if max_num_seqs else c for c in concurrency}


def decode_command(t: Target, batches: list[int], tokens: int, prompt_len: int) -> list[str]:
    cmd = [sys.executable, "-m", "harness.bench.engine", "decode", str(t.model_dir),
           "--batches", ",".join(map(str, batches)), "--tokens", str(tokens), "--prompt-len", str(prompt_len),
           "--json"]
    if t.device:
        cmd += ["--device", t.device]
    if t.dtype:
        cmd += ["--dtype", t.dtype]
    if t.max_model_len:
        cmd += ["--max-model-len", str(t.max_model_len)]
    if not t.cuda_graphs:
        cmd.append("--no-cuda-graphs")
    if not t.fused_kernels:
        cmd.append("--no-fused-kernels")
    return cmd


def run_static(t: Target, batches: list[int], tokens: int, prompt_len: int, timeout_s: float) -> dict:
    """harness.bench.engine decode's JSON result, with `tokens_per_s` keyed by int batch; raises
    RuntimeError with the command's tail when it fails."""
    cmd = decode_command(t, batches, tokens, prompt_len)
    print(f"bench serve: static decode: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"static decode ran past {timeout_s:.0f} s") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-15:])
        raise RuntimeError(f"static decode exited {p.returncode}:\n{tail}")
    res = json.loads(lines[-1])
    res["tokens_per_s"] = {int(b): float(v) for b, v in res["tokens_per_s"].items()}
    res["command"] = cmd[1:]
    return res
