"""`understudy bench load`: our cold load (page cache warm) vs a raw read of the same files by several
readers and by one (and, on CUDA, `safetensors.torch.load_file`)."""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from daemon.arena import bind, build_views, layout
from daemon.loader import default_threads, load_checkpoint_into
from models import build_model, read_model_args, torch_dtype
from harness.bench.attach import allocate


def _raw_read(files: list[Path], readers: int, chunk: int = 32 << 20) -> float:
    """GB/s of reading every byte of `files` with `readers` threads (chunks in file order)."""
    chunk = max(1, min(chunk, max(f.stat().st_size for f in files)))
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    bufs = [bytearray(chunk) for _ in range(readers)]  # (before the clock: zeroing a 32 MiB buffer a reader
    local = threading.local()  # took 10x longer than reading a small model's files)

    def read(job) -> int:
        if not hasattr(local, "buf"):
            local.buf = bufs.pop()
        return os.preadv(fds[job[0]], [local.buf], job[1])

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            total = sum(pool.map(read, jobs))
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)


def _our_load(model_dir: Path, device: str, gpu_id: int, dtype: str, threads: int | None) -> dict:
    """The daemon's fill path: model on meta, arena allocated, bound, loaded."""
    t0 = time.perf_counter()
    model = build_model(read_model_args(model_dir), dtype=torch_dtype(dtype), device="meta")
    manifest = layout(model)
    arena = allocate(manifest.total_bytes, device, gpu_id)
    bind(model, build_views(arena.region, manifest), manifest)
    t1 = time.perf_counter()
    stats = load_checkpoint_into(model, model_dir, threads=threads)
    del model
    arena.close()
    return {"alloc_s": t1 - t0, "load_s": stats.seconds, "gbps": stats.gbps, "bytes": stats.bytes}


def _safetensors_load(files: list[Path], gpu_id: int) -> float:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    total = 0
    for f in files:
        for t in load_file(f, device=f"cuda:{gpu_id}").values():
            total += t.numel() * t.element_size()
    torch.cuda.synchronize(gpu_id)
    return total / (time.perf_counter() - t0) / 1e9


def bench_load(args) -> dict:
    """Median over `repeat` rounds; each round runs every reader back to back on a warm page cache."""
    model_dir = Path(args.model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"understudy bench load: {model_dir} has no *.safetensors file")
    dtype = args.dtype or json.loads((model_dir / "config.json").read_text()).get("torch_dtype", "float32")
    threads = args.threads or default_threads()
    _raw_read(files, threads)  # warm the page cache: every reader below starts from the same state
    rounds: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        rounds.setdefault("raw_read_gbps", []).append(_raw_read(files, threads))
        rounds.setdefault("raw_read_1reader_gbps", []).append(_raw_read(files, 1))
        ours = _our_load(model_dir, args.device, args.gpu_id, dtype, threads)
        rounds.setdefault("load_gbps", []).append(ours["gbps"])
        rounds.setdefault("alloc_s", []).append(ours["alloc_s"])
        rounds.setdefault("load_with_alloc_gbps", []).append(ours["bytes"] / (ours["alloc_s"] + ours["load_s"]) / 1e9)
        if args.device == "cuda":
            rounds.setdefault("safetensors_load_file_gbps", []).append(_safetensors_load(files, args.gpu_id))
    out: dict = {"device": args.device, "dtype": dtype, "files": len(files),
                 "gb": sum(f.stat().st_size for f in files) / 1e9, "readers": threads}
    out.update({k: statistics.median(v) for k, v in rounds.items()})
    out["load_vs_raw_read"] = out["load_gbps"] / out["raw_read_gbps"]
    if args.device == "cuda":
        out["load_vs_safetensors"] = out["load_gbps"] / out["safetensors_load_file_gbps"]
    return out

