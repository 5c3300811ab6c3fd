"""Quick live probe: closed-loop streaming clients against an OpenAI endpoint (token-id prompts),
spread over several client processes so the client is not the bottleneck."""
import asyncio, multiprocessing as mp, random, sys, time
import httpx

def pct(xs, q): xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

async def one(client, url, model, rng, out_len, in_lo, in_hi, stats, prefix):
    prompt = (prefix or []) + [rng.randrange(10, 32000) for _ in range(rng.randint(in_lo, in_hi))]
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter(); last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            stats["errors"] += 1; await r.aread(); return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]": continue
            now = time.perf_counter()
            if last is None: stats["ttft"].append(now - t0)
            else: stats["itl"].append(now - last)
            last = now
    stats["ok"] += 1

def worker(args):
    url, model, conc, nreq, out_len, in_lo, in_hi, prefix, seed = args
    async def main():
        rng = random.Random(seed)
        stats = {"ttft": [], "itl": [], "errors": 0, "ok": 0}
        left = [nreq]
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=conc + 4)) as client:
            async def loop():
                while left[0] > 0:
                    left[0] -= 1
                    await one(client, url, model, rng, out_len, in_lo, in_hi, stats, prefix)
            await asyncio.gather(*[loop() for _ in range(conc)])
        return stats
    return asyncio.run(main())

def point(url, model, conc, nreq, out_len, in_lo, in_hi, prefix=None, procs=8):
    procs = min(procs, conc)
    args = [(url, model, conc // procs + (i < conc % procs), nreq // procs + (i < nreq % procs), out_len, in_lo, in_hi,
             prefix, conc * 100 + i) for i in range(procs)]
    t0 = time.perf_counter()
    with mp.Pool(procs) as pool:
        res = pool.map(worker, args)
    dt = time.perf_counter() - t0
    st = {k: sum((r[k] for r in res), [] if k in ("ttft", "itl") else 0) for k in res[0]}
    print(f"{url[-5:]} conc {conc:4d}: {st['ok'] * out_len / dt:9.0f} out tok/s  {st['ok'] / dt:7.1f} req/s  "
          f"TTFT p50 {pct(st['ttft'], .5)*1e3:7.1f} p99 {pct(st['ttft'], .99)*1e3:7.1f} ms  "
          f"ITL p50 {pct(st['itl'], .5)*1e3:6.2f} p99 {pct(st['itl'], .99)*1e3:6.2f} ms  errors {st['errors']}", flush=True)

if __name__ == "__main__":
    url, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "chat":
        for conc in (1, 32, 64, 256):
            point(url, model, conc, max(16, conc * 4), 128, 64, 512)
    elif mode == "direct":
        point(url, model, 256, 1024, 128, 64, 512)
    elif mode == "shared":
        prefix = [random.Random(7).randrange(10, 32000) for _ in range(1500)]
        point(url, model, 32, 256, 128, 32, 32, prefix)
