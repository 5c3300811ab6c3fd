"""`python -m daemon` refuses bad input with one clear line; the benchmarks run end to end."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from harness.bench.weights import main as bench_main

REPO = Path(__file__).resolve().parents[2]


def test_bad_input_exits_with_one_line_naming_it(tiny_model, tmp_path):
    arch = tmp_path / "arch"
    shutil.copytree(tiny_model, arch)
    cfg = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    quant = tmp_path / "quant"
    shutil.copytree(tiny_model, quant)
    (quant / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    cases = {  # argv -> (exit code, text the output must contain)
        "rank-outside": (["--model", str(tiny_model), "--rank", "3", "--tp-size", "2"], 2, "--rank 3 is outside 0..1"),
        "no-folder": (["--model", str(tmp_path / "nope")], 1, f"model folder {tmp_path / 'nope'} does not exist"),
        "unknown-arch": (["--model", str(arch)], 1, "'FooForCausalLM'"),
        "awq": (["--model", str(quant)], 1, "quant_method 'awq' is not supported"),
        "bad-dtype": (["--model", str(tiny_model), "--dtype", "int4"], 2, "invalid choice: 'int4'"),
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "daemon", *argv, "--runtime-dir", str(tmp_path / f"rt-{name}")],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, (argv, _, _) in cases.items()
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        code, text = cases[name][1:]
        assert proc.returncode == code, (name, out)
        assert text in out, (name, out)


def test_bench_attach_and_load_run(tiny_model, capsys):
    assert bench_main(["attach", "--tensors", "64", "--total-mb", "2", "--repeat", "1", "--json"]) == 0
    attach = json.loads(capsys.readouterr().out)
    assert attach["tensors"] == 64 and attach["arena_attach_ms"] > 0 and attach["per_tensor_attach_ms"] > 0
    assert bench_main(["load", str(tiny_model), "--repeat", "1", "--json"]) == 0
    load = json.loads(capsys.readouterr().out)
    assert load["gb"] > 0 and load["load_gbps"] > 0 and load["raw_read_gbps"] > 0
    assert load["load_vs_raw_read"] == load["load_gbps"] / load["raw_read_gbps"]
