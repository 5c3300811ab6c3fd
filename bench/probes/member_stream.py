"""What a batch member costs the router per chunk (supervisor/router/batching.py Member): the batch reader's
take() of one frame, then the continuation's next chunk from stream(). CPU only.

    python bench/probes/member_stream.py
"""
import asyncio, time
from supervisor.router.batching import Member
async def main():
    m = Member(b"/v1/completions", b"{}", 60)
    it = m.stream().__aiter__()
    loop = asyncio.get_running_loop()
    n = 50000
    t = time.perf_counter()
    for i in range(n):
        loop.call_soon(m.take, 200, b"data: x\n\n")
        await it.__anext__()
    print(f"{(time.perf_counter()-t)/n*1e6:.2f} us per chunk (take + wake + next)")
asyncio.run(main())
