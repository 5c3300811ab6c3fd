"""A stand-in for the weight cache daemons of vLLM and SGLang, with their command lines (the flags their
documentation names; any other is refused, as argparse does):

    daemon_stand_in.py vllm preload --model M [--tensor-parallel-size N] [--weight-cache-socket-dir D]
    daemon_stand_in.py sglang -m sglang.srt.weight_cache.daemon --model-path M [--tensor-parallel-size N]

It "loads" for LOAD_S, then does what the real one does once its weights are resident: vLLM's binds one
Unix socket per rank, ``D/vllm_weight_cache_gpu{G}.sock`` (G: the rank's entry of CUDA_VISIBLE_DEVICES),
and says "Weight cache daemon READY"; SGLang's binds the socket of $SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE
({device_uuid} filled) and says "All N weight cache daemons on node 0 are ready". Then it stays up,
accepting and closing connections, until a signal. ``daemon_socket(...)`` is where an engine stand-in
finds it (it refuses to start without it: the daemon must be READY before its engines)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

LOAD_S = 0.3


def vllm_socket(socket_dir: str, rank: int = 0) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    gpu = visible.split(",")[rank] if visible else str(rank)
    return os.path.join(socket_dir, f"vllm_weight_cache_gpu{gpu}.sock")


def sglang_socket(rank: int = 0) -> str:
    template = os.environ.get("SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE", "/tmp/sglang_weight_cache_{device_uuid}.sock")
    return template.format(device_uuid=f"GPU-stand-in-{rank}")


def daemon_up(path: str) -> bool:
    """Whether a daemon accepts connections at ``path`` (what an engine started in client mode needs)."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
        return True
    except OSError:
        return False


def serve(paths: list[str], ready_line: str) -> None:
    time.sleep(LOAD_S)
    servers = []
    for path in paths:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if os.path.exists(path):  # (a killed daemon's socket: the real ones remove it too)
            os.unlink(path)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen()
        servers.append(s)

    def stop(signum: int, frame: object) -> None:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(ready_line, flush=True)
    while True:
        conn, _ = servers[0].accept()
        conn.close()


def main(argv: list[str]) -> None:
    if argv[:2] == ["vllm", "preload"]:
        p = argparse.ArgumentParser(prog="vllm preload", allow_abbrev=False)
        p.add_argument("--model", required=True)
        p.add_argument("--tensor-parallel-size", type=int, default=1)
        p.add_argument("--weight-cache-socket-dir", default=None)
        p.add_argument("--weight-cache-health-port", type=int, default=None)
        a = p.parse_args(argv[2:])
        socket_dir = a.weight_cache_socket_dir or f"/tmp/vllm_weight_cache_{os.getuid()}"
        paths = [vllm_socket(socket_dir, r) for r in range(a.tensor_parallel_size)]
        serve(paths, f"===== Weight cache daemon READY: all {a.tensor_parallel_size} rank(s) serving in {socket_dir} =====")
    elif argv[:3] == ["sglang", "-m", "sglang.srt.weight_cache.daemon"]:
        p = argparse.ArgumentParser(prog="sglang.srt.weight_cache.daemon", allow_abbrev=False)
        p.add_argument("--model-path", required=True)
        p.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
        a = p.parse_args(argv[3:])
        n = a.tensor_parallel_size
        serve([sglang_socket(r) for r in range(n)], f"All {n} weight cache daemons on node 0 are ready "
                                                    f"(pp_ranks=0..0, tp_ranks=0..{n - 1}, dist_init_method=stand-in)")
    else:
        sys.exit(f"daemon_stand_in: not a daemon command line: {argv}")


if __name__ == "__main__":
    main(sys.argv[1:])
