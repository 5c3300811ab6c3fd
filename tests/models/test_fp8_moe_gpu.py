"""FP8 and Mixture-of-Experts on a GPU (issues 54, 55; `pytest -m gpu`): FP8 tensor cores through the
Triton products, the fused MoE step, both inside CUDA graphs (the same tokens as eager), the numerics
check on this GPU, and an engine process serving an FP8 MoE checkpoint."""
from __future__ import annotations

import httpx
import pytest
import torch

from daemon.loader import load_checkpoint_into
from models import build_model, read_model_args
from models.fp8 import Fp8Linear, has_fp8_cores
from models.make_model import make_model
from models.numerics import FP8_TOLERANCE, check_numerics
from wire.engine_config import EngineConfig
from harness.bench.decode import graphs_match_eager
from harness.engine_process import EngineProcess, all_graphs_line

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODELS = {"fp8-block": dict(preset="tiny", quant="fp8-block"), "fp8-tensor": dict(preset="tiny", quant="fp8-tensor"),
          "moe": dict(preset="moe-tiny", arch="qwen3_moe"),
          "moe-fp8": dict(preset="moe-tiny", arch="mixtral", quant="fp8-block", block=32)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return {name: make_model(tmp_path_factory.mktemp(name), seed=2, **kw) for name, kw in MODELS.items()}


GRAPHS_UNLIKE_EAGER = pytest.mark.xfail(strict=True, reason=(
    "per-tensor FP8: on an H100 graph tokens leave eager ones (2026-12-07, twice); suspected: a K block of 128 "
    "chained in wgmma's precision (64-row tiles, the padded graph) against mma.sync's (16 rows, eager), "
    "bench/probes/fp8_tile_bits.py asks the GPU (bench/RESULTS.md)"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=GRAPHS_UNLIKE_EAGER) if n == "fp8-tensor" else n
                                  for n in MODELS])
def test_cuda_graphs_give_eager_tokens(models, name) -> None:
    same, sizes = graphs_match_eager(str(models[name]), "cuda", "bfloat16")
    assert sizes["decode"] and same == {"torch": True, "fused": True}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_numerics_check_passes_on_this_gpu_and_catches_ignored_scales(models, name) -> None:
    model = build_model(read_model_args(models[name]), dtype=torch.bfloat16, device="meta").to_empty(device="cuda")
    load_checkpoint_into(model, models[name])
    check = check_numerics(model, torch.device("cuda"))
    print(name, check.summary())
    assert not check.failed, check.summary()
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if fp8 and has_fp8_cores(torch.device("cuda")):
        assert check.parts[0][2] == FP8_TOLERANCE
        for m in fp8:
            m.product = lambda x, m=m: torch.nn.functional.linear(x, m.weight.to(x.dtype))
        assert check_numerics(model, torch.device("cuda")).failed


def test_an_engine_serves_an_fp8_moe_checkpoint_on_the_gpu(models, tmp_path) -> None:
    cfg = EngineConfig(name="moe", model_path=str(models["moe-fp8"]), port=0, runtime_dir=str(tmp_path / "rt"),
                       device="cuda", gpu_ids=[0], dtype="bfloat16", kv_cache_bytes=64 << 20, max_num_seqs=8,
                       max_model_len=256)
    proc = EngineProcess(cfg, tmp_path / "moe.log")
    try:
        proc.wait_ready(180)
        log = (tmp_path / "moe.log").read_text()
        assert "numerics against float32 PyTorch: layer 0 attention" in log
        assert "{'decode': [1," in all_graphs_line(tmp_path / "moe.log")
        body = dict(model=models["moe-fp8"].name, prompt="Hello", max_tokens=16, temperature=0, ignore_eos=True)
        first = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert first and httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] \
            == first
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("m", [64, 130, 256])
def test_cublas_block_scaled_products_agree_with_ours_eager_and_in_a_graph(m) -> None:
    """From CUBLAS_ROWS rows an Fp8Linear of 128x128 blocks takes cuBLAS's block-scaled product where
    it runs: its result is ours (to the tensor cores' accumulation), in eager and in a CUDA graph."""
    from models.kernels.fp8 import CUBLAS_ROWS, cublas_block_scaled, fp8_matmul, quantize_rows
    from models.make_model import quantize_fp8
    from models.quant import Fp8Scheme
    dev = torch.device("cuda")
    if not cublas_block_scaled(dev):
        pytest.skip(f"cuBLAS's block-scaled product does not run here (torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda}): products stay Triton's")
    assert m >= CUBLAS_ROWS
    g = torch.Generator().manual_seed(m)
    linear = Fp8Linear(1024, 384, False, 0, 1, torch.bfloat16, dev, Fp8Scheme(kind="block", block=(128, 128)))
    wq, ws = quantize_fp8(torch.randn(384, 1024, generator=g).to(dev), (128, 128))
    linear.weight.copy_(wq)
    linear.scale.copy_(ws)
    assert linear.cublas_shape
    x = torch.randn(m, 1024, generator=g).to(dev, torch.bfloat16)
    ours = fp8_matmul(*quantize_rows(x, 128), wq, ws, 128, 128, 128, torch.bfloat16).float()
    eager = linear.product(x).float()
    assert ((eager - ours).norm() / ours.norm()).item() <= 1e-2
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = linear.product(x)
    graph.replay()
    assert torch.equal(out.float(), eager)
