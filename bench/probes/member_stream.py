"""What a batch member costs the router per chunk (supervisor/router/batching.py Member): the batch
reader's take() of one frame, then the continuation's next chunk from stream(). CPU only.

    python bench/probes/member_stream.py [--n 50000]
"""
from __future__ import annotations

import argparse
import asyncio
import time

from supervisor.router.batching import Member


async def per_chunk(n: int) -> float:
    member = Member(b"", 60)
    chunks = member.stream().__aiter__()
    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    for _ in range(n):
        loop.call_soon(member.take, 200, b"data: x\n\n")
        await chunks.__anext__()
    return (time.perf_counter() - t) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50_000)
    a = p.parse_args()
    print(f"{asyncio.run(per_chunk(a.n)) * 1e6:.2f} us per chunk (take + wake + next)")


if __name__ == "__main__":
    main()
