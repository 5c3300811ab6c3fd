import os, time, statistics, random
from daemon.kv_index import BlockIndex, index_bytes, SEALED
from daemon.kv_layout import KVLayout
n = 65536 + 1 + 3*32
layout = KVLayout(num_blocks=n, block_size=16, layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", scratch_slots=3, scratch_blocks=32)
size = index_bytes(n, 16)
fd = os.memfd_create("idx"); os.ftruncate(fd, size)
ix = BlockIndex(fd, size, layout)
ix.initialise(layout, b"f"*32, b"p"*16)
ix.claim(layout, b"f"*32)
rng = random.Random(0)
for b in range(layout.shared_start, n):
    ix.owned(b, 1); ix.sealed(b, 1, rng.getrandbits(64) | 1, rng.getrandbits(64), b)
ts = []
for _ in range(30):
    t = time.perf_counter(); a = ix.peek(layout, b"f"*32); ts.append(time.perf_counter() - t)
print(len(a.sealed), "median %.2f ms best %.2f ms" % (statistics.median(ts)*1e3, min(ts)*1e3))
