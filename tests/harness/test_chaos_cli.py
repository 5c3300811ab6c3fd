"""`understudy chaos` options and bad input: refused before running, or a partial report, never a hang."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from wire.loopback import free_port
from harness.chaos.cli import EXIT_ABORTED, EXIT_USAGE, main
from harness.chaos.options import ChaosOptions, parse_counts, require_loopback


@pytest.fixture()
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text("secret\n")
    p.chmod(0o600)
    return p


def test_only_loopback_targets() -> None:
    assert require_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert require_loopback("http://localhost:8000") == "http://localhost:8000"
    with pytest.raises(ValueError, match="loopback only"):
        require_loopback("http://192.0.2.1:8000")
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        require_loopback("ftp://127.0.0.1")


def test_fault_plan_is_exact_and_seeded() -> None:
    opts = ChaosOptions(data_url="http://127.0.0.1:1", admin_url="http://127.0.0.1:2", token="t", out_dir="x",
                        faults=parse_counts("kill-primary:5,kill-daemon:2", "--faults"), seed=7)
    plan = opts.fault_plan()
    assert sorted(plan) == ["kill-daemon"] * 2 + ["kill-primary"] * 5
    assert plan == opts.fault_plan() and "token" not in opts.public()
    with pytest.raises(ValueError, match="whole number"):
        parse_counts("kill-primary:1.5", "--faults")
    with pytest.raises(ValueError, match="expected NAME:NUMBER"):
        parse_counts("kill-primary", "--faults")


@pytest.mark.parametrize("extra, message", [
    (["--faults", "kill-everything:1"], "fault kind 'kill-everything'"),
    (["--mix", "embeddings:1"], "mix: expected finite weights"),
    (["--mix", "completion:nan"], "mix: expected finite weights"),
    (["--mix", "completion:0,chat:0"], "mix: at least one weight must be > 0"),
    (["--data-url", "http://192.0.2.1:8000"], "loopback only"),
    (["--rate", "0"], "rate"),
])
def test_bad_options_exit_2_with_one_line(extra: list[str], message: str, token_file: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--data-url", "http://127.0.0.1:1", "--admin-url", "http://127.0.0.1:2",
            "--token-file", str(token_file), "--out", str(tmp_path / "r"), *extra]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0
    assert not (tmp_path / "r").exists()


def test_unwritable_report_folder_exits_2(token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["--data-url", "http://127.0.0.1:1", "--admin-url", "http://127.0.0.1:2",
            "--token-file", str(token_file), "--out", str(blocker / "report")]
    assert main(argv) == EXIT_USAGE
    assert "cannot create the report folder" in capsys.readouterr().err


def test_missing_token_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--token-file", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == EXIT_USAGE
    assert "cannot read the admin token" in capsys.readouterr().err


def test_unreachable_supervisor_writes_a_partial_report(token_file: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = main(["--data-url", f"http://127.0.0.1:{free_port()}", "--admin-url", f"http://127.0.0.1:{free_port()}",
                 "--token-file", str(token_file), "--out", str(out), "--faults", "kill-primary:3"])
    assert code == EXIT_ABORTED  # at --dead-after, not the 600 s --duration: the report says why
    assert "admin API unreachable" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] is False and "unreachable" in report["aborted"]
    assert report["requests"]["all"]["sent"] == 0 and report["faults"] == []
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert checks["run completed"] is False and checks["every planned fault injected"] is False
    assert (out / "report.md").read_text().count("ABORTED") == 1
