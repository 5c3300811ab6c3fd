"""Leaving a tensor-parallel engine at exit, every rank together and within a bounded time.

NCCL's ``destroy_process_group`` is collective: it returns only once every rank has called it. Rank 0
used to wait for its workers to exit *before* destroying its own group, while each worker sat in its
own destroy waiting for rank 0: a deadlock that only the 30 s worker wait (or the supervisor's drain
timeout and SIGKILL) broke, so stopping a TP=2 engine took 31 s on GPUs. Now all ranks meet at a
barrier on the step group right after rank 0's EXIT broadcast (the same collective order on gloo and
NCCL, so a CPU test sees a wrong order as a hang too), destroy together, then rank 0 reaps the
workers. A deadline turns any hang left in teardown into a prompt exit.
"""
from __future__ import annotations

import os
import sys
import threading

import torch.distributed as dist

TEARDOWN_BUDGET_S = 3.0  # from the EXIT broadcast to the process exit


def exit_deadline(rc: int, budget_s: float = TEARDOWN_BUDGET_S) -> threading.Timer:
    """Exit with ``rc`` after ``budget_s`` unless cancelled (teardown hung: a peer rank died, a driver
    call never returned). The group's other ranks die with rank 0 (PDEATHSIG) or are killed by it."""
    def force() -> None:
        print(f"teardown did not finish in {budget_s:g}s; exiting now", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(rc)
    timer = threading.Timer(budget_s, force)
    timer.daemon = True
    timer.start()
    return timer


def leave_group(group: dist.ProcessGroup) -> None:
    """Every rank calls this after the step loop ends (rank 0: after broadcasting EXIT, BEFORE waiting
    for its workers): a barrier on the step group, then the collective destroy."""
    dist.barrier(group=group)
    dist.destroy_process_group()
