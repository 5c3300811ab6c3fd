import torch, sys
from pathlib import Path
from engines.models.make_model import make_model
from engines.models import read_model_args, build_model
from daemon.loader import load_checkpoint_into
from engines.models.paged import sequence_meta
import transformers
for arch in ("qwen3_moe", "mixtral"):
  for quant in ("none", "fp8-block"):
    d = Path(f"/tmp/moe_{arch}_{quant}"); make_model(d, "moe-tiny", arch=arch, quant=quant, block=16)
    args = read_model_args(d)
    m = build_model(args, dtype=torch.float32, device="meta").to_empty(device="cpu")
    load_checkpoint_into(m, d)
    m.allocate_kv_cache(8, 16, "cpu")
    ids = torch.arange(5, 11)
    out = m(ids, torch.arange(6), sequence_meta([1], 0, 6, 16, "cpu"))
    line = f"{arch} {quant} {out[-1, :4].tolist()} {out[-1].argmax().item()}"
    if quant == "none":
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        line += f" maxdiff vs HF {(ref - out).abs().max().item():.2e} rel {((ref-out).abs().max()/ref.abs().max()).item():.2e}"
    print(line)
