"""`bench decode` and `bench restart` run end to end on CPU and report sane, self-consistent figures."""
from __future__ import annotations

import json

from engines.process.startup import PHASES
from harness.bench import engine as bench
from harness.bench.restart import bench_restart


def test_bench_decode_cli_reports_batches_and_floor(tiny_model, capsys) -> None:
    assert bench.main(["decode", str(tiny_model), "--device", "cpu", "--batches", "1,4", "--tokens", "8",
                       "--prompt-len", "8", "--json"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "of it" in out
    res = json.loads(out.strip().splitlines()[-1])
    assert set(res["tokens_per_s"]) == {"1", "4"} and all(v > 0 for v in res["tokens_per_s"].values())
    assert res["weight_bytes"] > 0 and res["copy_bandwidth_gbps"] > 0
    assert res["batch1_fraction_of_floor"] == res["tokens_per_s"]["1"] / res["floor_tokens_per_s_batch1"]


def test_bench_restart_reports_cold_and_spawn_starts_consistently(tiny_model, tmp_path) -> None:
    """Both modes run and their figures hold together (every phase, a cache hit, the whole start at
    least its phases). Which is faster is the benchmark's finding (bench/RESULTS.md), not a test's."""
    res = bench_restart(str(tiny_model), "cpu", None, runs=1, kv_cache_bytes=8 << 20, max_num_seqs=4,
                              work_dir=tmp_path)
    cold, spawn = res["modes"]["cold"], res["modes"]["spawn"]
    for mode in (cold, spawn):
        assert mode["weights_source"] == ["cache_hit"]
        assert list(mode["phases"]) == list(PHASES)
        assert all(v >= 0 for v in mode["phases"].values()) and mode["ready_s"] > 0
