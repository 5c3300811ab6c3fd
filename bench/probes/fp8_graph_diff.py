"""Where per-tensor FP8's CUDA-graph tokens leave the eager ones (tests/engines/models/test_fp8_moe_gpu.py): each FP8
product, the activations' quantization and the bf16 LM head at 3 rows against the same 3 rows among 4
(a graph's padding) and 8, bit for bit; then the greedy tokens per batch, eager against graphs."""
from __future__ import annotations

import sys
import tempfile

import torch

from daemon.loader import load_checkpoint_into
from engines.kernels.fp8 import fp8_matmul, quantize_rows
from engines.models import build_model, read_model_args
from engines.models.fp8 import Fp8Linear
from engines.models.make_model import make_model
from engines.core.sampling import SamplingParams
from harness.bench.decode import local_engine, random_prompts


def rows_differ(f, x: torch.Tensor) -> list[int]:  # noqa: ANN001
    """Row counts (4, 8, 16, 64) at which f's first 3 rows differ from f on those 3 rows alone."""
    base = f(x[:3])
    return [m for m in (4, 8, 16, 64) if not torch.equal(f(x[:m])[:3], base)]


def main() -> None:
    quant = sys.argv[1] if len(sys.argv) > 1 else "fp8-tensor"
    d = make_model(tempfile.mkdtemp() + "/m", "tiny", seed=2, quant=quant)
    model = build_model(read_model_args(d), dtype=torch.bfloat16, device="meta").to_empty(device="cuda")
    load_checkpoint_into(model, d)
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            x = torch.randn(64, m.weight.shape[1], generator=g).to("cuda", torch.bfloat16)
            group = m.scale_cols if m.scheme.kind == "block" else x.shape[1]
            print(f"{name:40s} product {rows_differ(m.product, x)} quantize {rows_differ(lambda t: quantize_rows(t, group)[0].float(), x)}"
                  f" matmul-of-same-q {rows_differ(lambda t: fp8_matmul(*quantize_rows(t, group), m.weight, m.scale.view(m.scale.shape[0], -1), m.scale_rows, m.scale_cols, group, torch.bfloat16), x)}")
    x = torch.randn(64, model.lm_head.weight.shape[1], generator=g).to("cuda", torch.bfloat16)
    print(f"{'lm_head (bf16 F.linear)':40s} {rows_differ(model.lm_head, x)}")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = random_prompts(8, 16, 512, 5)
    outs = {}
    for graphs in (False, True):
        e = local_engine(str(d), "cuda", "bfloat16", max_num_seqs=8, max_len=64, cuda_graphs=graphs, fused_kernels=False)
        outs[graphs] = {b: e.generate(prompts[:b], params) for b in (1, 3, 8)}
        del e
    for b in (1, 3, 8):
        same = outs[False][b] == outs[True][b]
        print(f"batch {b}: graphs == eager: {same}")
        if not same:
            for i, (a, c) in enumerate(zip(outs[False][b], outs[True][b])):
                if a != c:
                    print(f"  seq {i}: eager {a}\n          graph {c}")


if __name__ == "__main__":
    main()
