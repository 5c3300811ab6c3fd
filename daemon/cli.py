"""`python -m daemon` / `understudy daemon`: run one rank's weight cache daemon in the foreground."""
from __future__ import annotations

import argparse
import os
import logging
import sys

from pydantic import ValidationError

from .runtime_dir import RuntimeDirError, default_runtime_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy daemon",
                                description="Hold one rank's weights in an arena and share it with engines.")
    p.add_argument("--model", required=True, help="HF checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank this daemon holds")
    p.add_argument("--tp-size", type=int, default=1, help="ranks of the tensor-parallel group (%(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the arena is (%(default)s)")
    p.add_argument("--gpu-id", type=int, default=None, help="GPU of this rank (default: the rank)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' dtype in the arena (%(default)s)")
    p.add_argument("--runtime-dir", default=str(default_runtime_dir()),
                   help="private folder of its socket, daemon-rankN.sock (%(default)s)")
    p.add_argument("--threads", type=int, default=None, help="reader threads for the cold load")
    p.add_argument("--max-load-mbps", type=float, default=None,
                   help="cap the cold-load read rate (MB/s), to rehearse slow disks")
    p.add_argument("--kv-pool-bytes", type=int, default=0,
                   help="allocate the rank's shared KV pool of this many bytes (0: none)")
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block of the pool")
    p.add_argument("--kv-slots", type=int, default=2, help="engine slots that get scratch blocks in the pool")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (%(default)s)")
    return p


def daemon_argv(model: str | os.PathLike, rank: int, tp_size: int, device: str, dtype: str,
                runtime_dir: str | os.PathLike, gpu_id: int | None = None, kv_pool_bytes: int = 0,
                kv_block_size: int = 16, kv_slots: int = 2) -> list[str]:
    """The command line that starts one rank's daemon with this interpreter."""
    argv = [sys.executable, "-m", "daemon", "--model", str(model), "--rank", str(rank), "--tp-size", str(tp_size),
            "--device", device, "--dtype", dtype, "--runtime-dir", str(runtime_dir)]
    if kv_pool_bytes:
        argv += ["--kv-pool-bytes", str(kv_pool_bytes), "--kv-block-size", str(kv_block_size),
                 "--kv-slots", str(kv_slots)]
    return argv + (["--gpu-id", str(gpu_id)] if device == "cuda" and gpu_id is not None else [])


def main(argv: list[str] | None = None) -> int:
    """Run the daemon until SIGTERM, then exit the process: 0 after SIGTERM, 1 if loading failed,
    2 on bad arguments or a live daemon on the same rank (returns 2 only for bad arguments)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s daemon[rank{args.rank}] %(levelname)s %(message)s")
    from .server import DaemonAlreadyRunning, DaemonConfig, WeightDaemon

    try:
        cfg = DaemonConfig(model_path=args.model, rank=args.rank, tp_size=args.tp_size, device=args.device,
                           gpu_id=args.gpu_id, dtype=args.dtype, runtime_dir=args.runtime_dir,
                           threads=args.threads, max_load_mbps=args.max_load_mbps,
                           kv_pool_bytes=args.kv_pool_bytes, kv_block_size=args.kv_block_size, kv_slots=args.kv_slots)
        if cfg.rank >= cfg.tp_size:
            raise ValueError(f"--rank {cfg.rank} is outside 0..{cfg.tp_size - 1} (--tp-size {cfg.tp_size})")
        daemon = WeightDaemon(cfg)
    except ValidationError as e:
        first = e.errors()[0]
        print(f"understudy daemon: bad argument {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    except (RuntimeDirError, ValueError, OSError) as e:
        print(f"understudy daemon: {e}", file=sys.stderr)
        return 2
    try:
        code = daemon.run()
    except (DaemonAlreadyRunning, OSError) as e:
        print(f"understudy daemon: {e}", file=sys.stderr)
        code = 2
    # Exit now: reader threads of an interrupted load must not delay a SIGTERM exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
