"""`understudy bench attach|load`: the two weight-path benchmarks, each ratio measured in one run.

- `attach --tensors N --total-mb M [--device cpu|cuda]`: an exporter process holds N tensors,
  either in one arena or one allocation per tensor; a fresh importer process receives the fds over
  AF_UNIX, maps them and builds the tensors (`attach_ms`: connect to last tensor built;
  `params_ms`: wrapping them in nn.Parameter). Reports both modes and their ratio.
- `load MODEL_DIR [--device cpu|cuda]`: our cold load (page cache warm) vs a raw read of the
  same files by several readers and by one (and, on CUDA, `safetensors.torch.load_file`).
"""
from __future__ import annotations

import argparse
import json
import sys

from harness.bench.attach import bench_attach, run_exporter, run_importer
from harness.bench.cold_load import bench_load


def main(argv: list[str] | None = None) -> int:
    """Entry point of `understudy bench ...` (argv without the word 'bench')."""
    p = argparse.ArgumentParser(prog="understudy bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attach", help="arena vs one-handle-per-tensor attach time")
    a.add_argument("--tensors", type=int, default=10_000)
    a.add_argument("--total-mb", type=float, default=1000.0)
    a.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a.add_argument("--gpu-id", type=int, default=0)
    a.add_argument("--repeat", type=int, default=3, help="importer processes per mode (median reported)")
    a.add_argument("--json", action="store_true")
    ld = sub.add_parser("load", help="cold-load GB/s vs raw read of the same files")
    ld.add_argument("model_dir")
    ld.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ld.add_argument("--gpu-id", type=int, default=0)
    ld.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default: the checkpoint's torch_dtype")
    ld.add_argument("--threads", type=int, default=None)
    ld.add_argument("--repeat", type=int, default=3)
    ld.add_argument("--json", action="store_true")
    for role in ("_export", "_import"):  # the processes `attach` starts
        r = sub.add_parser(role)
        r.add_argument("--mode", choices=["arena", "per_tensor"], required=True)
        r.add_argument("--socket", required=True)
        r.add_argument("--device", default="cpu")
        r.add_argument("--gpu-id", type=int, default=0)
        r.add_argument("--tensors", type=int, default=0)
        r.add_argument("--total-mb", type=float, default=0)
    args = p.parse_args(argv)
    if args.cmd == "_export":
        return run_exporter(args)
    if args.cmd == "_import":
        return run_importer(args)
    result = bench_attach(args) if args.cmd == "attach" else bench_load(args)
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    width = max(len(k) for k in result)
    return "\n".join(f"{k:<{width}}  {round(v, 4) if isinstance(v, float) else v}" for k, v in result.items())



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
