"""The logits of an FP8 checkpoint (FP8 products, activations quantized at run time) against the same
weights dequantized and multiplied in bf16 (GPU), on 3 prompts of 128 tokens: relative RMS error of
every position's logits, and how often the top token agrees. Also the numerics check on this model.
    python3 bench/probes/fp8_error.py MODEL_DIR"""
from __future__ import annotations

import sys

import torch

from daemon.loader import load_checkpoint_into
from models import build_model, read_model_args
from models.fp8 import Fp8Linear
from models.numerics import check_numerics
from models.paged import sequence_meta

model_dir = sys.argv[1]
args = read_model_args(model_dir)
model = build_model(args, dtype=torch.bfloat16, device="meta").to_empty(device="cuda")
load_checkpoint_into(model, model_dir)
print("numerics:", check_numerics(model, torch.device("cuda")).summary())
model.allocate_kv_cache(16, 16, "cuda")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, args.vocab_size, (128,), generator=g).cuda() for _ in range(3)]


def run() -> list[torch.Tensor]:
    return [model(p, torch.arange(128, device="cuda"), sequence_meta(list(range(1, 9)), 0, 128, 16, "cuda")).float()
            for p in prompts]


fp8 = run()
for m in model.modules():
    if isinstance(m, Fp8Linear):
        m.product = lambda x, m=m: torch.nn.functional.linear(x, m.dequantized(x.dtype))
ref = run()
err = [((a - b).norm(dim=-1) / b.norm(dim=-1)) for a, b in zip(fp8, ref)]
agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(fp8, ref))
errs = torch.cat(err)
print(f"logits of FP8 products vs the dequantized weights in bf16 ({errs.numel()} positions): relative RMS error "
      f"median {errs.median().item():.4f}, max {errs.max().item():.4f}; top token agrees at {agree} of {errs.numel()}")
