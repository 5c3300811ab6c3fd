"""transformers' continuous batching on bench serve's nano workload (the same 256 requests, lengths
and ids as `understudy bench serve --offline MODEL --workload nano`): output tok/s on the same GPU,
for the comparison issue 55 asks (bench/RESULTS.md). One line of JSON at the end.

    python3 bench/probes/transformers_cb.py MODEL_DIR [--device cuda] [--requests 256]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.bench.serve.workloads import WORKLOADS, make_requests  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="bench serve's --seed (its nano point's ids)")
    p.add_argument("--warmup", type=int, default=8, help="short requests first (graphs, kernels), untimed")
    a = p.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = json.loads((Path(a.model) / "config.json").read_text())
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, device_map=a.device)
    load_s = time.perf_counter() - t0
    specs = make_requests(WORKLOADS["nano"], a.requests, config["vocab_size"], a.seed + 7919)
    gen = GenerationConfig(max_new_tokens=max(s.max_tokens for s in specs), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        def run(batch: list) -> tuple[float, int]:
            t = time.perf_counter()
            waiting = {manager.add_request(s.prompt, max_new_tokens=s.max_tokens) for s in batch}
            tokens = 0
            while waiting:
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError(f"{len(waiting)} requests: no result within 600 s (or the manager stopped)")
                if out.request_id in waiting:
                    waiting.discard(out.request_id)
                    tokens += len(out.generated_tokens)
            return time.perf_counter() - t, tokens
        run([type(s)(s.prompt[:64], 8) for s in specs[:a.warmup]])
        wall, tokens = run(specs)
    finally:
        manager.stop(block=True)
    asked = sum(s.max_tokens for s in specs)
    print(json.dumps({"engine": f"transformers {transformers.__version__} continuous batching",
                      "model": a.model, "device": a.device, "dtype": str(dtype), "requests": len(specs),
                      "output_tokens": tokens, "output_tokens_asked": asked, "seconds": round(wall, 3),
                      "out_tok_s": round(tokens / wall, 1), "load_s": round(load_s, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
