"""Startup phases under cProfile when UNDERSTUDY_PROFILE_DIR names a directory, and only then."""
from __future__ import annotations

import os
import stat

from engines.process.phase_profile import PROFILE_DIR_ENV
from engines.process.startup import StartupTimer


def a_costly_warm_up() -> int:
    return sum(i * i for i in range(20_000))


def test_a_phase_profile_names_what_the_phase_ran(tmp_path, monkeypatch) -> None:
    out = tmp_path / "profiles"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(out))
    timer = StartupTimer()
    with timer.phase("graph_capture"):
        a_costly_warm_up()
    path = out / f"{os.getpid()}-graph_capture.txt"
    report = path.read_text()
    assert "a_costly_warm_up" in report and "cumulative" in report
    assert stat.S_IMODE(out.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "graph_capture" in timer.phases
    assert (out / f"{os.getpid()}-memory.txt").read_text().startswith("graph_capture ")


def test_no_profile_without_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with StartupTimer().phase("numerics"):
        a_costly_warm_up()
    assert list(tmp_path.iterdir()) == []
