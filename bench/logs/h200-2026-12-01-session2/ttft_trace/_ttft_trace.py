"""Temporary diagnosis, kept as a record (not part of the product): per-request TTFT timeline and event-loop lag, as JSON lines
in $UNDERSTUDY_TTFT_TRACE/<pid>.jsonl. time.monotonic() is CLOCK_MONOTONIC: comparable across processes."""
import asyncio, json, os, time
DIR = os.environ.get("UNDERSTUDY_TTFT_TRACE")
_f = None
def event(**kw):
    global _f
    if not DIR:
        return
    if _f is None:
        _f = open(f"{DIR}/{os.getpid()}.jsonl", "a", buffering=1)
    _f.write(json.dumps(kw) + "\n")
_started = set()
def lag_monitor(who):
    """Iteration latency: from a call_soon to its callback (the rest of the ready queue + one select)."""
    if not DIR or who in _started:
        return
    _started.add(who)
    loop = asyncio.get_running_loop()
    import gc
    st = {"lags": [], "last": time.monotonic(), "busy": [], "gc": [], "gc_t": 0.0, "ret": time.monotonic()}
    def gc_cb(phase, info):
        if phase == "start": st["gc_t"] = time.monotonic()
        else: st["gc"].append((info["generation"], time.monotonic() - st["gc_t"]))
    gc.callbacks.append(gc_cb)
    sel = loop._selector; orig = sel.select
    def select(timeout=None):
        t = time.monotonic(); st["busy"].append(t - st["ret"])
        r = orig(timeout); st["ret"] = time.monotonic(); return r
    sel.select = select
    def tick():
        t = time.monotonic()
        loop.call_soon(lambda: measured(t))
    def measured(t):
        now = time.monotonic()
        st["lags"].append(now - t)
        if now - st["last"] > 3:
            lags = sorted(st["lags"]); n = len(lags)
            b = sorted(st["busy"]); m = len(b)
            gcs = {g: [d for gg, d in st["gc"] if gg == g] for g in (0, 1, 2)}
            event(who=who, kind="lag", n=n, p50=lags[n // 2], p90=lags[n * 9 // 10], p99=lags[n * 99 // 100], max=lags[-1],
                  busy_frac=sum(b) / (now - st["last"]), it_p50=b[m // 2], it_p90=b[m * 9 // 10], it_p99=b[m * 99 // 100], it_max=b[-1], iters=m,
                  gc={g: [len(v), sum(v), max(v, default=0)] for g, v in gcs.items()})
            st["lags"], st["last"], st["busy"], st["gc"] = [], now, [], []
        loop.call_later(0.002, tick)
    loop.call_later(0.002, tick)
