"""What building a failover's batch members costs the router (supervisor/router/continuation.py
`Tracked.batch_member`): N streams of P prompt + D generated ids, their block keys hashed as the
router hashes them, each member's frame built and kept (as a failover keeps them until its batch
goes: each frame is fresh memory). Prints the median of R rounds. Runs on any tree with
`batch_member` (PYTHONPATH=TREE).

    python bench/probes/member_frames.py [--n 256] [--prompt 600] [--done 300] [--rounds 9]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array

from engines.block_keys import KeyChain
from supervisor.router.continuation import Tracked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--done", type=int, default=300)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    rng = random.Random(0)
    streams = []
    for seed in range(args.n):
        ids = [rng.randrange(32000) for _ in range(args.prompt + args.done)]
        req = Tracked("completions", {"model": "m", "prompt": ids[:args.prompt], "max_tokens": args.done + 100,
                                      "stream": True, "seed": seed})
        req.prompt_ids, req.output_ids = array("q", ids[:args.prompt]), array("q", ids[args.prompt:])
        req.keys = KeyChain(16)
        req.keys.catch_up(req.prompt_ids, req.output_ids)
        streams.append(req)
    took = []
    for _ in range(args.rounds):
        kept = []
        t = time.perf_counter()
        for req in streams:
            kept.append(req.batch_member(b"/v1/completions"))
        took.append(time.perf_counter() - t)
        del kept
    ms = sorted(t * 1e3 for t in took)
    print(f"{args.n} members of {args.prompt}+{args.done} ids, built and kept: median {statistics.median(ms):.2f} ms "
          f"of {args.rounds} (min {ms[0]:.2f}, max {ms[-1]:.2f})")


if __name__ == "__main__":
    main()
