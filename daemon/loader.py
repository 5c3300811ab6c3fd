"""Cold load: stream safetensors into a model's already-materialised tensors (cpu or cuda).

Bytes go straight from the file into the destination with `preadv` (cpu), or through per-thread
double-buffered pinned staging buffers whose host-to-device copies overlap the next read (cuda).
Several reader threads run at once. Shards that are not one contiguous byte range, and dtype
conversions, go through a temporary tensor.
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from models import CheckpointError
from models.checkpoint.check import SCALES

from .protocol import Progress
from .safetensors_index import TensorLocation, locate

CHUNK_BYTES = 32 << 20
_PROGRESS_EVERY_S = 0.05


@dataclass
class LoadStats:
    """What a load did: bytes read, wall seconds, GB/s, tensors, files."""

    bytes: int
    seconds: float
    gbps: float
    tensors: int
    files: int


@dataclass
class _Job:
    loc: TensorLocation
    dest: torch.Tensor
    shard_dim: int | None  # None when this rank takes the whole tensor
    rank: int
    size: int
    broadcast: bool = False  # a scale read whole, spread over (or sliced to) dest's rows


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


@torch.no_grad()
def load_checkpoint_into(model: nn.Module, model_dir: str | os.PathLike, *,
                         progress: Callable[[Progress], None] | None = None,
                         threads: int | None = None, max_mbps: float | None = None) -> LoadStats:
    """Fill every tensor named by `model.checkpoint_targets()`, then `model.process_weights()` (the
    rotary tables, FP8 processing), then check the FP8 scales.

    Raises CheckpointError naming the file and tensor on a missing folder, file or tensor, a wrong
    shape or dtype, or a truncated/corrupt file. `max_mbps` caps the read rate (slow-disk drills).
    """
    model_dir = Path(model_dir)
    targets = model.checkpoint_targets()
    locations = locate(model_dir, list(targets))
    check_no_stray_scales(model_dir, targets)
    tp_rank, tp_size = getattr(model, "tp_rank", 0), getattr(model, "tp_size", 1)
    _check_covered(model, {spec.param for spec in targets.values()})
    jobs = []
    for key, spec in targets.items():
        loc, param = locations[key], model.get_parameter(spec.param)
        if spec.broadcast:
            if loc.shape not in ((), (1,), tuple(spec.full_shape), (*spec.full_shape, 1)):
                raise CheckpointError(f"{loc.file}: tensor {key} has shape {loc.shape}, expected one value or "
                                      f"{tuple(spec.full_shape)} (a scale per tensor or per row)")
        elif loc.shape != tuple(spec.full_shape):
            raise CheckpointError(f"{loc.file}: tensor {key} has shape {loc.shape}, expected {tuple(spec.full_shape)}")
        if param.is_meta:
            raise CheckpointError(f"parameter {spec.param} is still on meta: materialise the model before loading")
        local = tuple(spec.local_shape(tp_size))
        base = param if spec.dst_index is None else param[spec.dst_index]
        dest = base.narrow(0, spec.dst_offset, local[0] if local else 1) if base.dim() else base
        if tuple(dest.shape) != (local or (1,)) and not (spec.broadcast and dest.numel() == math.prod(local)):
            raise CheckpointError(f"{loc.file}: tensor {key}: rank {tp_rank}'s slice {local} does not fit "
                                  f"parameter {spec.param} {tuple(param.shape)} at row {spec.dst_offset}")
        _check_dtype(loc, key, dest.dtype)
        shard_dim = spec.shard_dim if tp_size > 1 else None
        size = (loc.end - loc.start) // (tp_size if shard_dim is not None else 1)
        jobs.append(_Job(loc, dest, shard_dim, tp_rank, size, spec.broadcast))
    stats = _Reader(jobs, progress, threads or default_threads(), max_mbps).run()
    model.process_weights()
    check_scales(model, model_dir)
    return stats


def _check_dtype(loc: TensorLocation, key: str, want: torch.dtype) -> None:
    """A float tensor may be converted to the parameter's float dtype, except to or from FP8: an FP8
    weight read as if unquantized (or the reverse) computes garbage."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if (loc.dtype in fp8) != (want in fp8):
        what = ("config.json's quantization_config does not make it FP8" if loc.dtype in fp8
                else f"the engine expects {want} (quantization_config makes it FP8)")
        raise CheckpointError(f"{loc.file}: tensor {key} is {loc.dtype}, but {what}")
    if loc.dtype != want and not (loc.dtype.is_floating_point and want.is_floating_point):
        raise CheckpointError(f"{loc.file}: tensor {key} is {loc.dtype}, cannot load into {want}")
    if want == torch.float8_e4m3fn and loc.dtype != want:
        raise CheckpointError(f"{loc.file}: tensor {key} is {loc.dtype}, expected float8_e4m3fn")


def check_no_stray_scales(model_dir: Path, targets: dict) -> None:
    """A scale in the checkpoint that no loaded tensor takes (its weight is absent, or not FP8 here)
    is a CheckpointError naming it: its weight would be read without it."""
    from .safetensors_index import all_keys
    for key, file in all_keys(model_dir).items():
        if key.endswith(SCALES) and key not in targets:
            raise CheckpointError(f"{file}: tensor {key} is a quantization scale of no FP8 weight this engine loads "
                                  "(its weight is missing, or config.json's quantization_config does not cover it)")


def check_scales(model: nn.Module, model_dir: Path) -> None:
    """Every FP8 scale finite and > 0 (a zero or NaN scale zeroes or poisons its whole block)."""
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and name.rpartition(".")[2] in ("weight_scale_inv", "weight_scale", "input_scale",
                                                                     "gate_up_scale", "down_scale"):
            bad = ~(torch.isfinite(p) & (p > 0))
            if bool(bad.any()):
                at = [int(i) for i in bad.nonzero()[0].tolist()]
                raise CheckpointError(f"{model_dir}: scale {name} holds {p[tuple(at)].item()} at {at}: every FP8 scale "
                                      "must be finite and > 0")


def _check_covered(model: nn.Module, loaded: set[str]) -> None:
    loaded_ids = {id(model.get_parameter(name)) for name in loaded}
    for name, p in model.named_parameters():
        if id(p) not in loaded_ids:
            raise CheckpointError(f"parameter {name} has no checkpoint key in checkpoint_targets()")


class _Reader:
    """Runs the jobs on a thread pool; one open fd per file; progress rate-limited."""

    def __init__(self, jobs: list[_Job], progress, threads: int, max_mbps: float | None) -> None:
        self.jobs, self.progress, self.threads, self.max_mbps = jobs, progress, threads, max_mbps
        self.total = sum(j.size for j in jobs)
        self.done = 0
        self.lock = threading.Lock()
        self.last_report = 0.0
        self.local = threading.local()
        self.cuda_devices = {j.dest.device for j in jobs if j.dest.is_cuda}

    def run(self) -> LoadStats:
        files = sorted({j.loc.file for j in self.jobs})
        self.fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self.t0 = time.perf_counter()
        self._report(force=True)
        try:
            tasks = [t for job in self.jobs for t in self._tasks(job)]
            tasks.sort(key=lambda t: (str(t[0].loc.file), t[1]))  # sequential order per file
            with ThreadPoolExecutor(self.threads, thread_name_prefix="load") as pool:
                futures = [pool.submit(self._run_task, *t) for t in tasks]
                try:
                    for fut in futures:
                        fut.result()
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    raise
            for device in self.cuda_devices:  # the staged copies ran on side streams
                torch.cuda.synchronize(device)
        finally:
            for fd in self.fds.values():
                os.close(fd)
        seconds = time.perf_counter() - self.t0
        self._report(force=True)
        return LoadStats(self.total, seconds, self.total / max(seconds, 1e-9) / 1e9, len(self.jobs), len(files))

    def _tasks(self, job: _Job) -> list[tuple[_Job, int, int, int]]:
        """(job, file offset, dest byte offset, n) chunks; one whole-tensor task for the slow path."""
        if not self._direct(job):
            return [(job, job.loc.start, -1, job.loc.end - job.loc.start)]
        start = job.loc.start + (job.rank * job.size if job.shard_dim is not None else 0)
        return [(job, start + a, a, min(CHUNK_BYTES, job.size - a)) for a in range(0, job.size, CHUNK_BYTES)]

    @staticmethod
    def _direct(job: _Job) -> bool:
        """Bytes can go straight from the file: same dtype, contiguous, shard is one byte range."""
        if job.broadcast or job.loc.dtype != job.dest.dtype or not job.dest.is_contiguous():
            return False
        return job.shard_dim is None or all(d == 1 for d in job.loc.shape[:job.shard_dim])

    def _run_task(self, job: _Job, file_off: int, dest_off: int, n: int) -> None:
        fd = self.fds[job.loc.file]
        if dest_off < 0:
            self._copy_converted(job, fd)
        elif job.dest.is_cuda:
            self._copy_staged(job, fd, file_off, dest_off, n)
        else:
            flat = job.dest.view(-1).view(torch.uint8).numpy()
            _pread_into(fd, memoryview(flat)[dest_off:dest_off + n], file_off, job.loc)
        self._advance(n if dest_off >= 0 else job.size)

    def _copy_converted(self, job: _Job, fd: int) -> None:
        full = torch.empty(job.loc.shape, dtype=job.loc.dtype)
        _pread_into(fd, memoryview(full.view(-1).view(torch.uint8).numpy()), job.loc.start, job.loc)
        if job.broadcast:  # one value for every row, or one per row ([rows] or [rows, 1])
            full = full.reshape(-1)
            if full.numel() > 1 and job.shard_dim is not None:
                full = full.narrow(0, job.rank * job.dest.numel(), job.dest.numel())
            job.dest.copy_(full.expand(job.dest.numel()).view(job.dest.shape) if full.numel() == 1
                           else full.view(job.dest.shape))
            return
        if job.shard_dim is not None:
            width = job.dest.shape[job.shard_dim]
            full = full.narrow(job.shard_dim, job.rank * width, width)
        job.dest.copy_(full)

    def _copy_staged(self, job: _Job, fd: int, file_off: int, dest_off: int, n: int) -> None:
        st = getattr(self.local, "stager", None)
        if st is None:
            st = self.local.stager = _PinnedStager(job.dest.device)
        buf = st.next_buffer()
        _pread_into(fd, memoryview(buf.numpy())[:n], file_off, job.loc)
        st.copy(buf[:n], job.dest.view(-1).view(torch.uint8)[dest_off:dest_off + n])

    def _advance(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        if self.max_mbps:
            ahead = done / (self.max_mbps * 1e6) - (time.perf_counter() - self.t0)
            if ahead > 0:
                time.sleep(ahead)
        self._report()

    def _report(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.progress is None or (not force and now - self.last_report < _PROGRESS_EVERY_S):
            return
        self.last_report = now
        elapsed = now - self.t0
        self.progress(Progress(bytes_done=self.done, bytes_total=self.total, elapsed_s=elapsed,
                               gbps=self.done / max(elapsed, 1e-9) / 1e9))


class _PinnedStager:
    """Two pinned buffers per thread: read into one while the other's copy to the GPU runs."""

    def __init__(self, device: torch.device) -> None:
        # A new thread's current device is GPU 0: pinning memory there would give a rank-1 daemon
        # a CUDA context (~0.5 GiB) on GPU 0 too.
        torch.cuda.set_device(device)
        self.bufs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.stream = torch.cuda.Stream(device)
        self.i = 0

    def next_buffer(self) -> torch.Tensor:
        self.i ^= 1
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()  # its previous copy must be done before reuse
        return self.bufs[self.i]

    def copy(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dest.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[self.i] = ev


def _pread_into(fd: int, buf: memoryview, offset: int, loc: TensorLocation) -> None:
    pos = 0
    while pos < len(buf):
        k = os.preadv(fd, [buf[pos:]], offset + pos)
        if k == 0:
            raise CheckpointError(f"{loc.file}: truncated while reading tensor {loc.key} "
                                  f"(no data at byte {offset + pos})")
        pos += k
