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

from harness.bench.arg_types import positive_float, positive_int
from harness.bench.attach import bench_attach, run_exporter, run_importer
from harness.bench.cold_load import bench_load


ATTACH = "Attach time of N tensors held by another process: one arena vs one allocation per tensor, and the ratio."
LOAD = "Cold load of a checkpoint (page cache warm) vs a raw read of the same files, in GB/s."


def build_parser() -> argparse.ArgumentParser:
    """`attach` and `load`, and the two processes `attach` starts (not listed)."""
    p = argparse.ArgumentParser(prog="understudy bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{attach,load}")
    a = sub.add_parser("attach", help=ATTACH, description=ATTACH)
    a.add_argument("--tensors", type=positive_int, default=10_000, help="tensors the exporter holds (%(default)s)")
    a.add_argument("--total-mb", type=positive_float, default=1000.0, help="their total size in MB (%(default)s)")
    a.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live (%(default)s)")
    a.add_argument("--gpu-id", type=int, default=0, help="the CUDA device with --device cuda (%(default)s)")
    a.add_argument("--repeat", type=positive_int, default=3, help="importer processes per mode (median reported)")
    a.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ld = sub.add_parser("load", help=LOAD, description=LOAD)
    ld.add_argument("model_dir", help="checkpoint folder (*.safetensors and config.json)")
    ld.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the weights go (%(default)s)")
    ld.add_argument("--gpu-id", type=int, default=0, help="the CUDA device with --device cuda (%(default)s)")
    ld.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default: the checkpoint's torch_dtype")
    ld.add_argument("--threads", type=int, default=None, help="readers of our load and of the raw read (default: the "
                                                               "loader's, 2 to 8 by CPU count)")
    ld.add_argument("--repeat", type=int, default=3, help="rounds of every reader (median reported)")
    ld.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    for role, what in (("_export", "holds the tensors"), ("_import", "attaches them and times it")):
        r = sub.add_parser(role, description=f"(started by `attach`) the process that {what}.")
        r.add_argument("--mode", choices=["arena", "per_tensor"], required=True, help="one arena or one per tensor")
        r.add_argument("--socket", required=True, help="the AF_UNIX socket the fds go over")
        r.add_argument("--device", default="cpu", help="where the tensors live")
        r.add_argument("--gpu-id", type=int, default=0, help="the CUDA device")
        r.add_argument("--tensors", type=int, default=0, help="tensors to hold")
        r.add_argument("--total-mb", type=float, default=0, help="their total size in MB")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `understudy bench attach|load` (argv without the word 'bench')."""
    args = build_parser().parse_args(argv)
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
