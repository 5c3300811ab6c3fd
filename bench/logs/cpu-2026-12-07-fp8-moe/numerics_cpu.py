import torch
from pathlib import Path
from engines.models import read_model_args, build_model
from daemon.loader import load_checkpoint_into
from engines.models.numerics import check_numerics
from engines.models.fp8 import Fp8Linear
import torch.nn.functional as F
for d in ["/tmp/m_none", "/tmp/m_fp8-block", "/tmp/m_fp8-tensor", "/tmp/moe_qwen3_moe_none", "/tmp/moe_mixtral_fp8-block"]:
  for dtype in (torch.float32, torch.bfloat16):
    args = read_model_args(d)
    m = build_model(args, dtype=dtype, device="meta").to_empty(device="cpu")
    load_checkpoint_into(m, d)
    c = check_numerics(m, torch.device("cpu"))
    print(d, dtype, c.summary(), "FAILED" if c.failed else "ok")
# scales ignored
args = read_model_args("/tmp/m_fp8-block")
m = build_model(args, dtype=torch.float32, device="meta").to_empty(device="cpu")
load_checkpoint_into(m, "/tmp/m_fp8-block")
Fp8Linear.product = lambda self, x: F.linear(x, self.weight.to(x.dtype))
c = check_numerics(m, torch.device("cpu"))
print("ignoring scales:", c.summary())
try: c.raise_if_failed()
except Exception as e: print(e)
