"""An observer of the startup phases: with UNDERSTUDY_PROFILE_DIR set, each phase runs under
cProfile and its costliest functions go to `<dir>/<pid>-<phase>.txt` (where a slow restart spends
its time: first kernel launches, module loads, host work per captured graph)."""
from __future__ import annotations

import cProfile
import os
import pstats
from contextlib import contextmanager
from typing import Iterator

PROFILE_DIR_ENV = "UNDERSTUDY_PROFILE_DIR"
TOP = 45  # functions listed, by cumulative and by own time


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
        os.makedirs(out, mode=0o700, exist_ok=True)
        path = os.path.join(out, f"{os.getpid()}-{phase}.txt")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            stats = pstats.Stats(profile, stream=f)
            stats.sort_stats("cumulative").print_stats(TOP)
            stats.sort_stats("tottime").print_stats(TOP)
