"""`understudy bench decode|restart|validate`: engine benchmarks; each prints a short table.

- `decode MODEL_DIR`: tokens/s at batch 1, 8, 32 (greedy, in-process, CUDA graphs on CUDA); at
  batch 1 the fraction of the memory-bandwidth floor: (weight bytes per token / device copy
  bandwidth measured in the same run) / measured seconds per token.
- `restart MODEL_DIR`: restart-to-ready in `client` mode (a daemon holds the weights), by a cold
  `python -m engines` and by the spawn server; ready = a greedy completion answered over HTTP.
  Per-phase seconds from the engine's /startup.
- `validate`: the H200 check: make (or reuse) a checkpoint, CUDA graphs vs eager tokens, then
  both benchmarks; one summary table at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.bench.arg_types import positive_int, positive_ints
from harness.bench.decode import bench_decode, fused_as_accurate, fused_logit_error, graphs_match_eager, print_decode
from harness.bench.restart import bench_restart, print_restart


DECODE = ("Decode tokens/s at batch 1, 8, 32 (greedy, in-process) and the batch-1 fraction of the "
          "memory-bandwidth floor.")
RESTART = "Restart-to-ready in client mode (a daemon holds the weights): a cold exec vs the spawn server, per phase."
VALIDATE = "The H200 check: CUDA graphs vs eager tokens, then the decode and restart benchmarks, one summary table."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="understudy bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    dev_default = "cuda" if torch.cuda.is_available() else "cpu"
    d = sub.add_parser("decode", help=DECODE, description=DECODE)
    d.add_argument("model_dir", help="checkpoint folder")
    d.add_argument("--batches", type=positive_ints, default=[1, 8, 32], help="comma-separated batch sizes (1,8,32)")
    d.add_argument("--tokens", type=positive_int, default=128, help="tokens generated per sequence (%(default)s)")
    d.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per sequence (%(default)s)")
    d.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's context, as a server's (default: prompt-len + tokens + 8)")
    r = sub.add_parser("restart", help=RESTART, description=RESTART)
    r.add_argument("model_dir", help="checkpoint folder")
    r.add_argument("--runs", type=int, default=3, help="restarts per mode (median reported)")
    r.add_argument("--kv-cache-gb", type=float, default=1.0, help="the engine's KV cache, GiB (%(default)s)")
    r.add_argument("--max-num-seqs", type=int, default=16, help="the engine's batch cap (%(default)s)")
    r.add_argument("--work-dir", type=Path, default=None, help="keep logs here (default: temp, removed)")
    v = sub.add_parser("validate", help=VALIDATE, description=VALIDATE)
    v.add_argument("--model-dir", default=None, help="checkpoint to use (default: make the 1b preset in a temp dir)")
    v.add_argument("--preset", default="1b", help="the preset made when no --model-dir is given (%(default)s)")
    v.add_argument("--runs", type=int, default=3, help="restarts per mode in the restart benchmark")
    for p in (d, r, v):
        p.add_argument("--device", choices=["cpu", "cuda"], default=dev_default,
                       help="default: cuda when torch sees a GPU, else cpu")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="default: float32 on cpu, else the checkpoint's torch_dtype")
        p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    d.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    d.add_argument("--no-fused-kernels", action="store_true", help="decode through the torch path only")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    if ns.cmd == "decode":
        res = bench_decode(ns.model_dir, ns.device, ns.batches, ns.tokens,
                           ns.prompt_len, ns.dtype, not ns.no_cuda_graphs, not ns.no_fused_kernels,
                           ns.max_model_len)
        print_decode(res)
    elif ns.cmd == "restart":
        res = bench_restart(ns.model_dir, ns.device, ns.dtype, ns.runs, int(ns.kv_cache_gb * (1 << 30)),
                            ns.max_num_seqs, ns.work_dir)
        print_restart(res)
    else:
        res = validate(ns)
    if ns.json:
        print(json.dumps(res, default=str))
    return 0 if res.get("ok", True) else 1


def validate(ns: argparse.Namespace) -> dict:
    from models.make_model import make_model

    model_dir = ns.model_dir
    if model_dir is None:
        model_dir = str(Path(tempfile.gettempdir()) / f"understudy-bench-{ns.preset}")
        if not (Path(model_dir) / "config.json").exists():
            print(f"making the {ns.preset} checkpoint in {model_dir} ...", flush=True)
            make_model(model_dir, ns.preset)
    t0 = time.perf_counter()
    same, sizes = graphs_match_eager(model_dir, ns.device, ns.dtype)
    print(f"CUDA graphs {sizes or 'off (no CUDA)'}: tokens equal eager: {same} ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    ok = all(same.values())
    fused = fused_logit_error(model_dir, ns.device, ns.dtype)
    print(f"logit error against float32, teacher-forced: {fused}", flush=True)
    ok = ok and fused_as_accurate(fused)
    unfused = bench_decode(model_dir, ns.device, [1, 8, 32], 128, 64, ns.dtype, True, fused_kernels=False)
    print_decode(unfused)
    dec = bench_decode(model_dir, ns.device, [1, 8, 32], 128, 64, ns.dtype, True)
    print_decode(dec)
    rst = bench_restart(model_dir, ns.device, ns.dtype, ns.runs, 1 << 30, 16)
    print_restart(rst)
    spawn, cold = rst["modes"]["spawn"], rst["modes"]["cold"]
    rows = [
        ("CUDA graphs == eager tokens", "yes" if all(same.values()) else "NO", f"must be yes: {same}"),
        ("logit error vs fp32, fused", f"{fused.get('fused_vs_fp32', float('nan')):.2%}",
         f"torch path {fused.get('torch_vs_fp32', float('nan')):.2%}; must be within 25% of it"),
        ("decode batch 1 (tokens/s)", f"{dec['tokens_per_s'][1]:.1f}", ""),
        ("decode batch 8 (tokens/s)", f"{dec['tokens_per_s'][8]:.1f}", ""),
        ("decode batch 32 (tokens/s)", f"{dec['tokens_per_s'][32]:.1f}", ""),
        ("batch 1 / floor, no kernels", f"{unfused['batch1_fraction_of_floor']:.1%}", unfused["fused_decode"]),
        ("batch 1 / bandwidth floor", f"{dec['batch1_fraction_of_floor']:.1%}", "target >= 60%; " + dec["fused_decode"]),
        ("restart cold exec (s)", f"{cold['ready_s']:.3f}", ",".join(cold["weights_source"])),
        ("restart spawn server (s)", f"{spawn['ready_s']:.3f}", "target <= 2 s; " + ",".join(spawn["weights_source"])),
    ]
    print(f"\n{'check':<30}{'value':>12}  note")
    for name, value, note in rows:
        print(f"{name:<30}{value:>12}  {note}")
    return {"ok": ok, "model_dir": model_dir, "graph_sizes": sizes, "fused_vs_torch": fused, "decode": dec,
            "decode_unfused": unfused,
            "restart": rst}


if __name__ == "__main__":
    sys.exit(main())
