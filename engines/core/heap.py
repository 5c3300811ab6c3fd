"""The engine core's heap keeps the memory it frees (glibc's malloc), so that a promotion touches no
new page.

A promotion's claim reads the whole shared pool's index into arrays of a few MB (daemon/kv_index.py
`_read`). Under glibc's defaults each read's arrays were handed back to the kernel when freed, and
the next read faulted them in again: 735 page faults a read of 65k blocks on the dev VM. On the H200
host 5 claims in 20 spent 56-79 ms sorting the keys, against 2 ms in the others (bench/RESULTS.md,
sixth session). With mmap's threshold and the trim threshold raised, the memory of a parked
standby's rehearsals (engines/core/engine.py `_rehearse`) stays in place for its claim: on the dev VM
16 faults in the claim, none in its sort. On the H200, 2 claims in 20 still took ~3,900 faults
there (47 and 76 ms, all on CPU): fewer slow claims, not none.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("engines.core.heap")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_ABOVE = 64 << 20  # allocations from this size still get their own mapping
KEEP_FREED = 256 << 20  # free memory kept at the top of the heap


def keep_freed_memory() -> bool:
    """Raise glibc's thresholds for this process (False, logged, where there is no glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED) == 1
    except (OSError, AttributeError) as e:
        log.info("the heap's thresholds are the C library's: %s", e)
        return False
    if not done:
        log.info("the heap's thresholds are the C library's: mallopt refused them")
    return done
