"""An observer of the startup phases: with UNDERSTUDY_PROFILE_DIR set, each phase runs under
cProfile and its costliest functions go to `<dir>/<pid>-<phase>.txt` (where a slow restart spends
its time: first kernel launches, module loads, host work per captured graph), and the GPU memory
after each phase to `<dir>/<pid>-memory.txt` (the device's used memory beside what torch's allocator
holds: what grows outside the allocator, phase by phase)."""
from __future__ import annotations

import cProfile
import os
import pstats
from contextlib import contextmanager
from typing import Iterator

PROFILE_DIR_ENV = "UNDERSTUDY_PROFILE_DIR"
TOP = 45  # functions listed, by cumulative and by own time


def _private_file(out: str, name: str, mode: str):  # noqa: ANN202
    os.makedirs(out, mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    return open(os.open(os.path.join(out, f"{os.getpid()}-{name}"), flags, 0o600), mode)


def _memory_line(phase: str) -> str:
    import torch  # (only when profiling: the startup timer's importers need not pay for it)

    if not torch.cuda.is_initialized():
        return f"{phase:<14} (no CUDA context yet)\n"
    free, total = torch.cuda.mem_get_info()
    return (f"{phase:<14} device used {(total - free) / 2**20:>9.0f} MiB   torch's allocator reserves "
            f"{torch.cuda.memory_reserved() / 2**20:>7.0f} MiB\n")


@contextmanager
def profiled(phase: str) -> Iterator[None]:
    """Profile the block into the profile directory, if one is set; else nothing."""
    out = os.environ.get(PROFILE_DIR_ENV)
    if not out:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        with _private_file(out, f"{phase}.txt", "w") as f:
            stats = pstats.Stats(profile, stream=f)
            stats.sort_stats("cumulative").print_stats(TOP)
            stats.sort_stats("tottime").print_stats(TOP)
        with _private_file(out, "memory.txt", "a") as f:
            f.write(_memory_line(phase))
