"""Mixture-of-Experts decoders (issue 55), on CPU: Qwen3-MoE and Mixtral against transformers, the
fused MoE kernels through Triton's interpreter against the plain path, and the refusals of bad
configs and checkpoints, one line each. On a GPU: tests/models/test_fp8_moe_gpu.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels on CPU: Triton's interpreter (set before triton runs)

from daemon.arena import layout
from models import CheckpointError, build_model, read_model_args
from models.make_model import make_model
from models.moe import route
from models.numerics import check_numerics
from tests.tiny_checkpoints import PROMPTS, edited_copy, load, logits  # noqa: E402

transformers = pytest.importorskip("transformers")
@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for arch in ("qwen3_moe", "mixtral"):
        for quant in ("none", "fp8-block"):
            out[arch, quant] = make_model(tmp_path_factory.mktemp(f"{arch}-{quant}"), "moe-tiny", arch=arch,
                                          quant=quant, block=32, seed=5)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_logits_and_greedy_match_transformers(moe, arch) -> None:
    model_dir = moe[arch, "none"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load(model_dir)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        assert (logits(ours, prompt) - want).abs().max().item() <= 1e-4, prompt
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref_out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    out = []
    for _ in range(8):
        out.append(int(logits(ours, prompt + out)[-1].argmax()))
    assert out == ref_out


def test_the_arena_holds_a_few_tensors_per_layer_whatever_the_expert_count(moe) -> None:
    """Experts are stacked: the arena (one attach, one view each) does not grow with the experts."""
    args = read_model_args(moe["qwen3_moe", "fp8-block"])
    model = build_model(args)
    keys = model.checkpoint_targets()
    per_layer = sum(1 for k in keys if k.startswith("model.layers.0."))
    # q/k/v/o and their scales, q/k norms, layer norms, the router, every expert's gate/up/down and scales
    assert per_layer == 4 * 2 + 2 + 2 + 1 + args.num_experts * 3 * 2
    arena = layout(model).names  # qkv/o and scales, q/k norms, layer norms, the router, stacked experts and scales
    assert sum(1 for n in arena if n.startswith("model.layers.0.")) == 4 + 2 + 2 + 1 + 4


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
@pytest.mark.parametrize("quant", ["none", "fp8-block"])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_fused_experts_match_the_plain_path(moe, quant, rows) -> None:
    """The grouped Triton products (interpreter here, natively on a GPU) against the per-expert loop;
    with FP8 experts, on the same quantized activations (the kernel's quantizer, dequantized)."""
    from models.kernels.fp8 import quantize_rows
    from models.kernels.moe import fused_experts
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load(moe["qwen3_moe", quant], device=dev)
    block = model.model.layers[1].ffn
    x = torch.randn(rows, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(dev)
    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    ex = block.experts
    got = fused_experts(x, weights, ids, ex.gate_up_proj, ex.down_proj,
                        (ex.gate_up_scale, ex.down_scale) if ex.scheme else None, ex.scheme.block if ex.scheme else None)
    if quant == "none":
        want = block.experts(x, weights, ids)
    else:
        group = block.experts.scheme.block[1]

        def fp8(a: torch.Tensor) -> torch.Tensor:  # what the kernel multiplies: a quantized and back
            q, s = quantize_rows(a, group)
            return q.float() * s.repeat_interleave(group, 1)
        want = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            gate_up, down = block.experts.dequantized(expert, torch.float32)
            gate, up = (fp8(x[tokens]) @ gate_up.T).chunk(2, dim=-1)
            want.index_add_(0, tokens, (fp8(torch.nn.functional.silu(gate) * up) @ down.T) * weights[tokens, slot, None])
    err = ((got - want).norm() / want.norm()).item()
    assert err <= (1e-5 if dev == "cpu" else 5e-3), err  # (a GPU multiplies float32 in TF32)


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
@pytest.mark.parametrize("experts,top_k,renormalize", [(8, 2, True), (128, 8, False), (60, 4, True)])
def test_routing_in_one_launch_picks_torchs_top_k_with_its_weights(experts, top_k, renormalize) -> None:
    from models.kernels.moe import route_tokens
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(37, experts, generator=torch.Generator().manual_seed(experts)).to(torch.bfloat16)
    want_w, want_ids = route(logits, top_k, renormalize)  # (torch's ops: the logits on CPU)
    got_w, got_ids = (a.cpu() for a in route_tokens(logits.to(dev), top_k, renormalize))

    def by_id(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (bf16 logits tie often;
        order = ids.argsort(-1)  # torch orders a tie either way)
        return w.gather(-1, order), ids.gather(-1, order)
    assert got_ids.dtype == torch.int64 and torch.equal(by_id(got_w, got_ids)[1], by_id(want_w, want_ids)[1])
    torch.testing.assert_close(by_id(got_w, got_ids)[0], by_id(want_w, want_ids)[0], rtol=1e-6, atol=1e-7)
    assert (got_w[:, :-1] >= got_w[:, 1:]).all()  # largest first
    tie = torch.tensor([[0.0, 2.0, 1.0, 2.0]])  # (a tie goes to the lower id)
    assert route_tokens(tie.to(dev), 2, True)[1].tolist() == [[1, 3]]


def sorted_by_expert(ids: torch.Tensor, experts: int, bm: int) -> tuple[list[int], list[int]]:
    """group_by_expert's contract in plain torch: the rows by expert (stable), each expert's padded to
    whole blocks of bm with T * k, then padding blocks to the kernel's fixed size; each block's expert."""
    flat = ids.flatten()
    n = flat.numel()
    rows, labels = [], []
    for e in range(experts):
        mine = (flat == e).nonzero().flatten().tolist()
        mine += [n] * (-len(mine) % bm)
        rows += mine
        labels += [e] * (len(mine) // bm)
    total = -(-(n + min(experts, n) * (bm - 1)) // bm) * bm
    return rows + [n] * (total - len(rows)), labels + [-1] * (total // bm - len(labels))


@pytest.mark.gpu  # (a kernel: natively on a GPU, through Triton's interpreter on CPU)
@pytest.mark.parametrize("tokens,experts,top_k,bm", [(1, 8, 2, 16), (37, 8, 2, 16), (300, 128, 8, 32),
                                                     (700, 64, 8, 64), (9, 3, 2, 16)])
def test_grouping_by_expert_keeps_each_experts_rows_in_order_padded_to_whole_blocks(tokens, experts, top_k,
                                                                                    bm) -> None:
    """Against the contract in plain torch, exactly: from one chunk of rows to 5,600 (44 chunks, past
    one tile of 32 chunks), experts from 3 to 128, with experts that get no row."""
    from models.kernels.moe import group_by_expert
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[ids == 1] = 0  # (expert 1 gets no row)
    rows, block_expert = group_by_expert(ids.to(dev), experts, bm)
    assert (rows.tolist(), block_expert.tolist()) == sorted_by_expert(ids, experts, bm)


@pytest.mark.gpu
def test_grouping_by_expert_pads_each_experts_rows_to_whole_blocks() -> None:
    from models.kernels.moe import group_by_expert
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]])  # rows 0..5 = token * 2 + choice
    rows, block_expert = group_by_expert(ids, 4, 4)
    pad = 6
    assert rows.tolist()[:12] == [0, 5, pad, pad, 3, pad, pad, pad, 1, 2, 4, pad]
    assert block_expert.tolist()[:3] == [0, 1, 3] and set(block_expert.tolist()[3:]) == {-1}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_experts_and_the_numerics_check(moe, arch) -> None:
    plain, fp8 = load(moe[arch, "none"]), load(moe[arch, "fp8-block"])
    assert fp8.model.layers[0].ffn.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert [int(logits(fp8, p)[-1].argmax()) for p in PROMPTS] == [int(logits(plain, p)[-1].argmax()) for p in PROMPTS]
    for model in (plain, fp8, load(moe[arch, "fp8-block"], torch.bfloat16)):
        check = check_numerics(model, torch.device("cpu"))
        assert not check.failed, check.summary()
        assert {"layer 0 routing", "layer 0 experts"} <= {p.name for p in check.parts}


def test_experts_that_ignore_their_scales_fail_the_numerics_check(moe) -> None:
    """The experts' share of the issue's failure: FP8 experts cast without their scales pass the
    routing (the router is bf16) and fail the experts' part, naming the layer."""
    model = load(moe["qwen3_moe", "fp8-block"])
    for experts in (layer.ffn.experts for layer in model.model.layers):
        def unscaled(x, weights, ids, experts=experts):  # noqa: ANN001, ANN202
            scheme, experts.scheme = experts.scheme, None  # (the engine's path then casts the weights alone)
            try:
                return type(experts).forward(experts, x, weights, ids)
            finally:
                experts.scheme = scheme
        experts.forward = unscaled
    check = check_numerics(model, torch.device("cpu"))
    assert [p.name for p in check.failed][:1] == ["layer 0 experts"], check.summary()
    assert not any("routing" in p.name for p in check.failed)


def many_experts(moe: dict[str, Path], seed: int):  # noqa: ANN201 (CausalLM)
    """moe-tiny with 128 experts and top-8 (Qwen3-30B-A3B's routing), random bf16 weights: the k-th and
    (k+1)-th experts of a token often nearly tie, and bf16's routing may pick either."""
    args = read_model_args(moe["qwen3_moe", "none"]).model_copy(update={"num_experts": 128, "num_experts_per_tok": 8})
    model = build_model(args, dtype=torch.bfloat16, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.3)
    model.init_buffers()
    return model


def test_the_numerics_check_counts_every_token_however_often_experts_tie(moe) -> None:
    """Every token is checked on the engine's own picks (a token whose experts nearly tie too: either
    pick is right), and picks outside float32's top k fail it, naming the layer."""
    model = many_experts(moe, 1)
    x = model.model.layers[0].post_attention_layernorm(model.model.embed_tokens(torch.arange(16)))
    ranked = (x.float() @ model.model.layers[0].ffn.gate.weight.float().T).topk(9, -1).values
    assert int(((ranked[:, 7] - ranked[:, 8]) < 2e-2 * ranked[:, 0].abs()).sum()) >= 4  # (near ties are common)
    check = check_numerics(model, torch.device("cpu"))
    assert not check.failed, check.summary()
    gate = model.model.layers[0].ffn.gate
    gate.forward = lambda h: -torch.nn.functional.linear(h, gate.weight)  # a router that picks the wrong experts
    check = check_numerics(model, torch.device("cpu"))
    assert check.failed[0].name == "layer 0 routing" and check.failed[0].error > 0.5
    with pytest.raises(ValueError, match=r"layer 0 routing: share of its 128 picks outside float32's top 8 "):
        check.raise_if_failed()


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
BAD = {  # config or checkpoint edit -> the error naming the key or tensor
    "top_k": (lambda c: c.__setitem__("num_experts_per_tok", 9), None,
              r"num_experts_per_tok: expected 1..8 \(the experts\), got 9"),
    "no_experts": (lambda c: c.__setitem__("num_experts", 0), None, r"num_experts: expected an integer >= 1"),
    "missing_expert": (None, lambda s: s.pop(EXPERT), rf"tensor {EXPERT} is missing"),
    "expert_shape": (None, lambda s: s.__setitem__(EXPERT, torch.zeros(32, 64)),
                     rf"tensor {EXPERT} has shape \(32, 64\), expected \(64, 64\)"),
    "router_size": (None, lambda s: s.__setitem__("model.layers.0.mlp.gate.weight", torch.zeros(7, 64)),
                    r"tensor model.layers.0.mlp.gate.weight has shape \(7, 64\), expected \(8, 64\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_moe_checkpoint_is_one_line_naming_the_key_or_tensor(moe, tmp_path, case) -> None:
    config, tensors, line = BAD[case]
    with pytest.raises(CheckpointError, match=line):
        load(edited_copy(moe["qwen3_moe", "none"], tmp_path / case, config, tensors))


def test_deterministic_mode_is_refused_for_moe(moe) -> None:
    from engines.core.runner import ModelRunner
    with pytest.raises(ValueError, match="engines.deterministic: not available for this checkpoint's "
                                         "Mixture-of-Experts layers"):
        ModelRunner(load(moe["mixtral", "none"]), torch.device("cpu"), deterministic=True)
