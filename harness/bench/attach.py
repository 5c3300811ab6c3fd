"""`understudy bench attach`: an exporter process holds N tensors, in one arena or one allocation per
tensor; a fresh importer process receives the fds over AF_UNIX, maps them and builds the tensors
(the two processes run `python -m harness.bench.weights _export | _import`)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from daemon.arena import ALIGN, Manifest, build_views
from daemon.framing import recv_frame, send_frame
from harness import ROOT

_FD_BATCH = 250  # SCM_RIGHTS carries at most 253 fds per message
_DTYPE = torch.float16


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
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen([sys.executable, "-m", "harness.bench.weights", *argv], env=env, **kw)


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise RuntimeError(f"need {need} open files, the hard limit is {hard} (raise `ulimit -Hn`)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def allocate(size: int, device: str, gpu_id: int):
    if device == "cpu":
        from daemon.transport_cpu import CpuArena

        return CpuArena(size)
    from daemon.transport_cuda import CudaArena

    return CudaArena(size, gpu_id)


def run_exporter(args) -> int:
    """Hold the tensors (value i % 1000 in tensor i) and hand their fds to each importer."""
    from daemon.transport_cpu import sealed_blob

    shape, nbytes = _shapes(args.tensors, args.total_mb)
    t0 = time.perf_counter()
    if args.mode == "arena":
        manifest = _manifest(args.tensors, shape, nbytes)
        arena = allocate(manifest.total_bytes, args.device, args.gpu_id)
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
            a = allocate(nbytes, args.device, args.gpu_id)
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


def run_importer(args) -> int:
    """Attach as an engine would, timed from connect to the last tensor built; print one JSON line."""
    if args.device == "cuda":
        from daemon.transport_cuda import use_primary_context

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
    from daemon.transport_cpu import read_blob

    header, fds = recv_frame(conn)
    manifest = Manifest.model_validate_json(read_blob(fds[1]))
    if args.device == "cpu":
        from daemon.transport_cpu import map_readonly

        region, keep = map_readonly(fds[0], header["size"])
    else:
        from daemon.transport_cuda import import_readonly

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
        from daemon.transport_cuda import import_readonly
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

