"""What the numerics check costs on a GPU, first call against later ones (is it the check, or the
first launch of each kernel?), and what torch's allocator holds after it, with and without
empty_cache (the engine empties it). The weights load from disk into this process.
    python3 bench/probes/numerics_cost.py MODEL_DIR"""
from __future__ import annotations

import sys
import time

import torch

from daemon.loader import load_checkpoint_into
from models import build_model, read_model_args
from models.numerics import check_numerics


def main() -> None:
    path, dev = sys.argv[1], torch.device("cuda")
    t0 = time.perf_counter()
    model = build_model(read_model_args(path), dtype=torch.bfloat16, device="meta").to_empty(device=dev)
    load_checkpoint_into(model, path)
    model.init_buffers()
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved(dev)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; allocator {base / 2**20:.0f} MiB")
    for i in range(3):
        check = check_numerics(model, dev)
        held = (torch.cuda.memory_reserved(dev) - base) / 2**20
        print(f"check {i + 1}: {check.seconds * 1e3:.0f} ms; allocator +{held:.0f}"
              f" MiB; {check.summary()}", flush=True)
    torch.cuda.empty_cache()
    print(f"after empty_cache: allocator +{(torch.cuda.memory_reserved(dev) - base) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
