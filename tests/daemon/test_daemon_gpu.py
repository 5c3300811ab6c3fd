"""The `cuda` transport on a real GPU (skipped without one): run on the H200 by the lead."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_transport_shares_read_only_and_survives_the_daemon(tiny_model):
    from harness.gpu_check import run_checks

    rows = run_checks(tiny_model, gpu=0)
    failed = [f"{name}: {detail}" for name, ok, detail in rows
              if not ok and name != "memory counted once (nvidia-smi)"]  # tiny arena < context noise
    assert len(rows) == 5 and not failed, failed


def test_bench_attach_cuda_runs(capsys):
    from harness.bench.weights import main

    assert main(["attach", "--tensors", "1000", "--total-mb", "256", "--device", "cuda", "--repeat", "1", "--json"]) == 0
    assert "per_tensor_over_arena" in capsys.readouterr().out
