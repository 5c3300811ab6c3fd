"""FP8 checkpoints served right or refused (issue 54), on CPU: the engine's model in both HF layouts
against transformers on the dequantized twin, the loader's processing and checks, and every refusal
as one line from `serve --check`. The FP8 kernels themselves run on a GPU (tests/models/test_fp8_moe_gpu.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import CheckpointError
from models.fp8 import Fp8Linear
from models.make_model import make_model
from models.numerics import check_numerics
from tests.tiny_checkpoints import PROMPTS, edited_copy, load, logits

transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels on CPU: Triton's interpreter (set before triton runs)
ROOT = Path(__file__).resolve().parents[3]
@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict[str, Path]:
    """The tiny preset in each FP8 layout (block-wise 32x32, per tensor)."""
    return {q: make_model(tmp_path_factory.mktemp(q), "tiny", quant=q, seed=3) for q in ("fp8-block", "fp8-tensor")}


def dequantized_twin(src: Path, dst: Path) -> Path:
    """The checkpoint with every FP8 weight times its scales in float32 and no quantization_config."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for key, t in state.items():
        if key.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = state[key[:-len("weight")] + ("weight_scale_inv" if "weight_block_size" in qc else "weight_scale")]
            if scale.dim() == 2:
                bn, bk = qc["weight_block_size"]
                scale = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            elif scale.dim() == 1:
                scale = scale[:, None]
            t = t.float() * scale
        out[key] = t.float()
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("quant", ["fp8-block", "fp8-tensor"])
def test_fp8_logits_match_transformers_on_the_dequantized_checkpoint(fp8, quant, tmp_path) -> None:
    ours = load(fp8[quant])
    assert any(isinstance(m, Fp8Linear) for m in ours.modules())
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    ref = transformers.AutoModelForCausalLM.from_pretrained(dequantized_twin(fp8[quant], tmp_path / "twin"),
                                                            dtype=torch.float32).eval()
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        got = logits(ours, prompt)
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3, prompt


def test_fp8_twin_stays_close_to_the_unquantized_model(fp8, tmp_path) -> None:
    """make-model's FP8 checkpoint is the same random model quantized: its greedy picks agree."""
    plain = load(make_model(tmp_path / "plain", "tiny", seed=3))
    for quant in fp8:
        q = load(fp8[quant])
        assert [int(logits(q, p)[-1].argmax()) for p in PROMPTS] == [int(logits(plain, p)[-1].argmax()) for p in PROMPTS]


def test_per_channel_and_static_scales_load_and_compute(fp8, tmp_path) -> None:
    """Per-channel weight scales ([rows, 1], compressed-tensors' shape) and static input scales: the
    fused q/k/v take one input scale (the largest: the load's processing), each part its own rows."""
    def per_channel(state: dict) -> None:
        for i, key in enumerate(sorted(k for k in state if k.endswith(".weight_scale"))):
            rows = state[key[:-len("_scale")]].shape[0]
            state[key] = state[key].reshape(1, 1).expand(rows, 1).contiguous()
            state[key[:-len("weight_scale")] + "input_scale"] = torch.tensor(0.02 + 0.01 * (i % 3))

    def static(cfg: dict) -> None:
        cfg["quantization_config"]["activation_scheme"] = "static"
    model_dir = edited_copy(fp8["fp8-tensor"], tmp_path / "static", static, per_channel)
    model = load(model_dir)
    attn = model.model.layers[0].self_attn.qkv_proj
    state = load_file(str(model_dir / "model.safetensors"))
    parts = [state[f"model.layers.0.self_attn.{p}.input_scale"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(attn.input_scale, torch.stack(parts).max().expand(3))
    assert torch.equal(attn.weight_scale[:64], state["model.layers.0.self_attn.q_proj.weight_scale"][:, 0])
    assert logits(model, PROMPTS[0]).isfinite().all()
    assert not check_numerics(model, torch.device("cpu")).failed


def test_an_engine_that_ignores_the_scales_fails_the_numerics_check(fp8) -> None:
    """The failure of the issue: FP8 weights cast without their scales. The golden canary cannot see
    it (every engine agrees with itself); the numerics check names the layer, the error, the bound."""
    model = load(fp8["fp8-block"])
    assert not check_numerics(model, torch.device("cpu")).failed
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.product = lambda x, m=m: torch.nn.functional.linear(x, m.weight.to(x.dtype))
    check = check_numerics(model, torch.device("cpu"))
    assert [p[0] for p in check.failed][:2] == ["layer 0 attention", "layer 0 MLP"]
    with pytest.raises(ValueError, match=r"numerics check failed: layer 0 attention: relative error [0-9.e+]+ "
                                         r"against float32 PyTorch .* \(tolerance 0.005\)"):
        check.raise_if_failed()


@pytest.mark.parametrize("bad", ["zero", "nan"])
def test_a_zero_or_nan_scale_is_refused_at_load_naming_it(fp8, tmp_path, bad) -> None:
    key = "model.layers.1.mlp.down_proj.weight_scale_inv"

    def poison(state: dict) -> None:
        state[key] = state[key].clone()
        state[key][0, 1] = 0.0 if bad == "zero" else float("nan")
    model_dir = edited_copy(fp8["fp8-block"], tmp_path / bad, tensors=poison)
    with pytest.raises(CheckpointError, match=r"scale model.layers.1.mlp.down_proj.weight_scale_inv holds .* at "
                                              r"\[0, 1\]: every FP8 scale must be finite and > 0"):
        load(model_dir)


def _drop(key: str):  # noqa: ANN202
    return lambda state: state.pop(key)


def _set_quant(qc: dict):  # noqa: ANN202
    return lambda cfg: cfg.__setitem__("quantization_config", qc)


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
REFUSED = {  # checkpoint edit -> the one line serve --check (and serve) print
    "gptq": (_set_quant({"quant_method": "gptq", "bits": 4}), None,
             "quantization_config: quant_method 'gptq' is not supported"),
    "awq": (_set_quant({"quant_method": "awq", "bits": 4}), None, "quant_method 'awq' is not supported"),
    "bitsandbytes": (_set_quant({"quant_method": "bitsandbytes", "load_in_4bit": True}), None,
                     "quant_method 'bitsandbytes' is not supported"),
    "unknown": (_set_quant({"quant_method": "mystery"}), None, "quant_method 'mystery' is not supported"),
    "marlin": (_set_quant({"quant_method": "marlin"}), None, "quant_method 'marlin' is not supported"),
    "ct_int4": (_set_quant({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}), None,
        "compressed-tensors config_groups.group_0.weights 'int' of 4 bits is not supported"),
    "no_scale": (None, _drop(SCALE), f"FP8 tensor model.layers.0.self_attn.q_proj.weight has no scale {SCALE}"),
    "scale_shape": (None, lambda s: s.__setitem__(SCALE, torch.ones(3, 3)),
                    f"scale {SCALE} has shape [3, 3], expected [2, 2] (one per 32x32 block of a 64x64 weight)"),
    "scale_dtype": (None, lambda s: s.__setitem__(SCALE, torch.ones(2, 2, dtype=torch.int32)),
                    f"scale {SCALE} is I32, expected a float (F32)"),
    "undeclared_fp8": (lambda cfg: cfg.pop("quantization_config"), None,
                       "tensor model.layers.0.mlp.down_proj.weight is F8_E4M3, but config.json declares no "
                       "quantization_config"),
    "stray_scale": (None, lambda s: s.__setitem__("model.layers.0.self_attn.x_proj.weight_scale_inv", torch.ones(1, 1)),
                    "tensor model.layers.0.self_attn.x_proj.weight_scale_inv is a quantization scale of no FP8 "
                    "weight (model.layers.0.self_attn.x_proj.weight is missing)"),
    "block_misfit": (lambda cfg: cfg["quantization_config"].__setitem__("weight_block_size", [48, 48]), None,
                     "quantization_config.weight_block_size [48, 48]: hidden_size 64 is not a whole number of 48x48 "
                     "blocks"),
}


def _check(cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "serve", "--check", "-c", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", REFUSED)
def test_every_refusal_is_one_line_from_serve_check(fp8, tmp_path, case) -> None:
    config, tensors, line = REFUSED[case]
    model_dir = edited_copy(fp8["fp8-block"], tmp_path / "ckpt", config, tensors)
    cfg = tmp_path / "understudy.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path / 'rt'}\nmodel: {{path: {model_dir}}}\n")
    r = _check(cfg)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert line in r.stderr and "Traceback" not in r.stderr, r.stderr
    problems = [x for x in r.stderr.splitlines() if x.startswith("understudy: invalid config")]
    assert len(problems) == 1, r.stderr


def test_the_loader_refuses_what_serve_check_refuses(fp8, tmp_path) -> None:
    """The same checks where the weights are read (the daemon, an engine's own load), naming the tensor."""
    for case in ("no_scale", "undeclared_fp8", "stray_scale"):
        config, tensors, _ = REFUSED[case]
        with pytest.raises(CheckpointError, match=r"(weight_scale_inv|F8_E4M3|float8_e4m3fn|scale of no FP8)"):
            load(edited_copy(fp8["fp8-block"], tmp_path / case, config, tensors))


def test_deterministic_mode_is_refused_for_fp8(fp8, tmp_path) -> None:
    cfg = tmp_path / "understudy.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path / 'rt'}\nmodel: {{path: {fp8['fp8-block']}}}\nengines: {{deterministic: true}}\n")
    r = _check(cfg)
    assert r.returncode == 2 and "engines.deterministic: not available for this checkpoint's FP8 weights" in r.stderr


def test_a_good_fp8_checkpoint_passes_serve_check(fp8, tmp_path) -> None:
    for model_dir in fp8.values():
        cfg = tmp_path / "understudy.yaml"
        cfg.write_text(f"runtime_dir: {tmp_path / 'rt'}\nmodel: {{path: {model_dir}}}\n")
        r = _check(cfg)
        assert r.returncode == 0 and "config OK" in r.stdout, r.stderr


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
@pytest.mark.parametrize("kind", ["block", "rows", "static"])
@pytest.mark.parametrize("m", [1, 17, 130])
def test_the_fp8_product_kernel_computes_the_product_of_what_it_quantized(kind, m) -> None:
    """models/kernels/fp8.py (interpreter here, natively on a GPU: tests/models/test_fp8_moe_gpu.py): the
    product of the quantized activations and the FP8 weight, scales applied, to float32 rounding."""
    from models.kernels.fp8 import fp8_matmul, quantize_rows, quantize_static
    from models.make_model import quantize_fp8
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 256, generator=g).to(dev), torch.randn(96, 256, generator=g).to(dev)
    if kind == "block":
        wq, ws = quantize_fp8(w, (32, 128))
        xq, xs = quantize_rows(x, 128)
        got = fp8_matmul(xq, xs, wq, ws, 32, 128, 128, torch.float32)
        w_deq = wq.float() * ws.repeat_interleave(32, 0).repeat_interleave(128, 1)
        x_deq = xq.float() * xs.repeat_interleave(128, 1)
    else:
        wq, ws = quantize_fp8(w, None)
        ws = ws.expand(96).contiguous()
        if kind == "rows":
            xq, xs = quantize_rows(x, 256)
        else:
            xq, xs = quantize_static(x, torch.tensor([0.05], device=dev))
        got = fp8_matmul(xq, xs, wq, ws.view(96, 1), 1, 256, 256, torch.float32)
        w_deq, x_deq = wq.float() * ws[:, None], xq.float() * xs
    want = x_deq @ w_deq.T
    # (FP8 tensor cores accumulate inside each product in less than float32: ~2e-4 seen on an H200)
    assert ((got - want).norm() / want.norm()).item() <= (1e-5 if dev == "cpu" else 1e-3)
    # and near the unquantized product (FP8's rounding; the interpreter's float8 cast truncates)
    assert ((got - x @ w.T).norm() / (x @ w.T).norm()).item() <= 0.2


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
def test_activations_quantized_for_cublas_are_ours_in_its_layout() -> None:
    """quantize_rows(for_cublas=True): the same values, rows padded to a multiple of 4 and the scales
    column-major, as cuBLAS's block-scaled product reads them."""
    from models.kernels.fp8 import quantize_rows
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(7)).to(dev)
    (q, s), (cq, cs) = quantize_rows(x, 128), quantize_rows(x, 128, for_cublas=True)
    assert cq.shape == (8, 512) and cs.shape == (8, 4) and cs.stride() == (1, 8)
    assert torch.equal(cq[:7].view(torch.uint8), q.view(torch.uint8)) and torch.equal(cs[:7], s)


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
@pytest.mark.parametrize("k", [1000, 4096 + 128])  # (a part group last; more groups than one program takes)
def test_activation_scales_are_each_groups_amax_over_448(k) -> None:
    from models.kernels.fp8 import quantize_rows
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(dev)
    q, s = quantize_rows(x, 128)
    padded = torch.nn.functional.pad(x, (0, -k % 128))
    want = padded.view(5, -1, 128).abs().amax(-1).clamp(min=1e-12) / 448.0
    assert s.shape == want.shape and torch.allclose(s, want, rtol=1e-6)
    back = q.float() * s.repeat_interleave(128, 1)[:, :k]
    assert ((back - x).norm() / x.norm()).item() < 0.08  # (float8 rounding; the interpreter truncates)
