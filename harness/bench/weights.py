"""`understudy bench attach|load`: the two weight-path benchmarks, each ratio measured in one run.

- `attach --tensors N --total-mb M [--device cpu|cuda]`: an exporter process holds N tensors,
  either in one arena or one allocation per tensor; a fresh importer process receives the fds over
  AF_UNIX, maps them and builds the tensors (`attach_ms`: connect to last tensor built;
  `params_ms`: wrapping them in nn.Parameter). Reports both modes and their ratio.
- `load MODEL_DIR [--device cpu|cuda]`: our cold load (page cache warm) vs a raw read of the
  same files by several readers and by one (and, on CUDA, `safetensors.torch.load_file`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .arena import ALIGN, Manifest, build_views
from .framing import recv_frame, send_frame

_FD_BATCH = 250  # SCM_RIGHTS carries at most 253 fds per message
_DTYPE = torch.float16


def main(argv: list[str] | None = None) -> int:
    """Entry point of `understudy bench ...` (argv without the word 'bench')."""
    p = argparse.ArgumentParser(prog="understudy bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attach", help="arena vs one-handle-per-tensor attach time")
    a.add_argument("--tensors", type=int, default=10_000)
    a.add_argument("--total-mb", type=float, default=1000.0)
    a.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a.add_argument("--gpu-id", type=int, default=0)
    a.add_argument("--repeat", type=int, default=3, help="importer processes per mode (median reported)")
    a.add_argument("--json", action="store_true")
    ld = sub.add_parser("load", help="cold-load GB/s vs raw read of the same files")
    ld.add_argument("model_dir")
    ld.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ld.add_argument("--gpu-id", type=int, default=0)
    ld.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default: the checkpoint's torch_dtype")
    ld.add_argument("--threads", type=int, default=None)
    ld.add_argument("--repeat", type=int, default=3)
    ld.add_argument("--json", action="store_true")
    for role in ("_export", "_import"):  # the processes `attach` starts
        r = sub.add_parser(role)
        r.add_argument("--mode", choices=["arena", "per_tensor"], required=True)
        r.add_argument("--socket", required=True)
        r.add_argument("--device", default="cpu")
        r.add_argument("--gpu-id", type=int, default=0)
        r.add_argument("--tensors", type=int, default=0)
        r.add_argument("--total-mb", type=float, default=0)
    args = p.parse_args(argv)
    if args.cmd == "_export":
        return _export(args)
    if args.cmd == "_import":
        return _import(args)
    result = bench_attach(args) if args.cmd == "attach" else bench_load(args)
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    width = max(len(k) for k in result)
    return "\n".join(f"{k:<{width}}  {round(v, 4) if isinstance(v, float) else v}" for k, v in result.items())


# ---- attach ----------------------------------------------------------------------------------
def _shapes(tensors: int, total_mb: float) -> tuple[list[int], int]:
    nbytes = max(ALIGN, int(total_mb * 1e6 / tensors) // ALIGN * ALIGN)
    elems = nbytes // _DTYPE.itemsize
    return ([elems // 64, 64] if elems % 64 == 0 else [elems]), nbytes


def _manifest(tensors: int, shape: list[int], nbytes: int) -> Manifest:
    c = torch.empty(shape, device="meta")
    return Manifest(total_bytes=tensors * nbytes, names=[f"t{i}" for i in range(tensors)],
                    dtypes=["float16"] * tensors, shapes=[shape] * tensors, strides=[list(c.stride())] * tensors,
                    offsets=[i * nbytes for i in range(tensors)], nbytes=[nbytes] * tensors,
                    kinds=["param"] * tensors, persistent=[True] * tensors)


def bench_attach(args) -> dict:
    """Run exporter + importer processes for both modes; median attach time of `repeat` importers."""
    shape, nbytes = _shapes(args.tensors, args.total_mb)
    tmp = Path(tempfile.mkdtemp(prefix="understudy-bench-"))
    out: dict = {"device": args.device, "tensors": args.tensors, "total_mb": args.tensors * nbytes / 1e6,
                 "tensor_shape": "x".join(map(str, shape))}
    try:
        for mode in ("arena", "per_tensor"):
            common = ["--mode", mode, "--socket", str(tmp / f"{mode}.sock"), "--device", args.device,
                      "--gpu-id", str(args.gpu_id)]
            exporter = _spawn(["_export", *common, "--tensors", str(args.tensors), "--total-mb", str(args.total_mb)],
                              stdout=subprocess.PIPE)
            try:
                ready = exporter.stdout.readline()
                if not ready:
                    raise RuntimeError(f"bench exporter ({mode}) exited with code {exporter.wait()}")
                out[f"{mode}_export_s"] = json.loads(ready)["export_s"]
                runs = []
                for _ in range(args.repeat):
                    imp = _spawn(["_import", *common], stdout=subprocess.PIPE)
                    line, _ = imp.communicate(timeout=600)
                    if imp.returncode:
                        raise RuntimeError(f"bench importer ({mode}) exited with code {imp.returncode}")
                    runs.append(json.loads(line))
            finally:
                exporter.kill()
                exporter.wait()
            out[f"{mode}_attach_ms"] = statistics.median(r["attach_ms"] for r in runs)
            out[f"{mode}_params_ms"] = statistics.median(r["params_ms"] for r in runs)
            out[f"{mode}_attach_with_params_ms"] = statistics.median(r["attach_ms"] + r["params_ms"] for r in runs)
        out["per_tensor_over_arena"] = out["per_tensor_attach_ms"] / out["arena_attach_ms"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _spawn(argv: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen([sys.executable, "-m", "daemon.bench", *argv], env=env, **kw)


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise RuntimeError(f"need {need} open files, the hard limit is {hard} (raise `ulimit -Hn`)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _allocate(size: int, device: str, gpu_id: int):
    if device == "cpu":
        from .transport_cpu import CpuArena

        return CpuArena(size)
    from .transport_cuda import CudaArena

    return CudaArena(size, gpu_id)


def _export(args) -> int:
    """Hold the tensors (value i % 1000 in tensor i) and hand their fds to each importer."""
    from .transport_cpu import sealed_blob

    shape, nbytes = _shapes(args.tensors, args.total_mb)
    t0 = time.perf_counter()
    if args.mode == "arena":
        manifest = _manifest(args.tensors, shape, nbytes)
        arena = _allocate(manifest.total_bytes, args.device, args.gpu_id)
        for i, v in enumerate(build_views(arena.region, manifest).values()):
            v.fill_(i % 1000)
        arena.finish()
        manifest_fd = sealed_blob(manifest.model_dump_json().encode())
        header = {"size": arena.size}
        fds = [arena.export_fd(), manifest_fd]
    else:
        _raise_fd_limit(args.tensors + 1000)
        allocs = []
        for i in range(args.tensors):
            a = _allocate(nbytes, args.device, args.gpu_id)
            a.region[:nbytes].view(_DTYPE).fill_(i % 1000)
            a.finish()
            allocs.append(a)
        header = {"size": allocs[0].size, "count": args.tensors, "shape": shape, "nbytes": nbytes}
        fds = [a.export_fd() for a in allocs]
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(args.socket)
    srv.listen(8)
    print(json.dumps({"export_s": time.perf_counter() - t0}), flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            if args.mode == "arena":
                send_frame(conn, header, fds)
            else:
                send_frame(conn, header)
                for i in range(0, len(fds), _FD_BATCH):
                    socket.send_fds(conn, [b"f"], fds[i:i + _FD_BATCH])
            conn.recv(1)  # wait for the importer to finish


def _import(args) -> int:
    """Attach as an engine would, timed from connect to the last tensor built; print one JSON line."""
    if args.device == "cuda":
        from .transport_cuda import use_primary_context

        use_primary_context(args.gpu_id)
        torch.empty(1, device=f"cuda:{args.gpu_id}")  # context creation is not attach time
    t0 = time.perf_counter()
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(args.socket)
    if args.mode == "arena":
        tensors, keep = _import_arena(conn, args)
    else:
        tensors, keep = _import_per_tensor(conn, args)
    t1 = time.perf_counter()
    params = [torch.nn.Parameter(t, requires_grad=False) for t in tensors]
    t2 = time.perf_counter()
    n = len(tensors)
    for i in (0, n // 2, n - 1):
        got = float(params[i].view(-1)[0])
        if got != i % 1000:
            raise RuntimeError(f"tensor {i} reads {got}, expected {i % 1000}")
    conn.send(b"x")
    print(json.dumps({"attach_ms": (t1 - t0) * 1e3, "params_ms": (t2 - t1) * 1e3, "tensors": n}), flush=True)
    return 0


def _import_arena(conn: socket.socket, args):
    from .transport_cpu import read_blob

    header, fds = recv_frame(conn)
    manifest = Manifest.model_validate_json(read_blob(fds[1]))
    if args.device == "cpu":
        from .transport_cpu import map_readonly

        region, keep = map_readonly(fds[0], header["size"])
    else:
        from .transport_cuda import import_readonly

        region, keep = import_readonly(fds[0], header["size"], args.gpu_id)
    for fd in fds:
        os.close(fd)
    return list(build_views(region, manifest).values()), keep


def _import_per_tensor(conn: socket.socket, args):
    import mmap
    import warnings

    header, _ = recv_frame(conn)
    count, size, shape, nbytes = header["count"], header["size"], header["shape"], header["nbytes"]
    if args.device == "cuda":
        from .transport_cuda import import_readonly
    tensors, keep = [], []
    while len(tensors) < count:
        _, fds, _, _ = socket.recv_fds(conn, 16, min(_FD_BATCH, count - len(tensors)))
        for fd in fds:
            if args.device == "cpu":
                m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    region = torch.frombuffer(m, dtype=torch.uint8)
                keep.append(m)
            else:
                region, mapping = import_readonly(fd, size, args.gpu_id)
                keep.append(mapping)
            os.close(fd)
            tensors.append(region[:nbytes].view(_DTYPE).view(shape))
    return tensors, keep


# ---- load ------------------------------------------------------------------------------------
def _raw_read(files: list[Path], readers: int, chunk: int = 32 << 20) -> float:
    """GB/s of reading every byte of `files` with `readers` threads (chunks in file order)."""
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    local = threading.local()

    def read(job) -> int:
        if not hasattr(local, "buf"):
            local.buf = bytearray(chunk)
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
    from engines.models import build_model, read_model_args, torch_dtype

    from .arena import bind, layout
    from .loader import load_checkpoint_into

    t0 = time.perf_counter()
    model = build_model(read_model_args(model_dir), dtype=torch_dtype(dtype), device="meta")
    manifest = layout(model)
    arena = _allocate(manifest.total_bytes, device, gpu_id)
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
    from .loader import default_threads

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
