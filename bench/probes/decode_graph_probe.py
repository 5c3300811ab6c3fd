"""Probe (GPU): does the model's Decode step capture in a CUDA graph, and how close to the
memory-bandwidth floor does it run? Random weights, 1b preset shapes, bf16, no checkpoint."""
import json, sys, time
import torch
from engines.make_model import PRESETS, ARCHS
from engines.models import ModelArgs, build_model, Decode, Prefill

cfg = dict(PRESETS["1b"]); cfg.update(arch=ARCHS["llama"], head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
args = ModelArgs.model_validate(cfg)
dev = torch.device("cuda")
t0 = time.perf_counter()
model = build_model(args, dtype=torch.bfloat16).to_empty(device=dev)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.init_buffers()
max_len = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
model.allocate_kv_cache(num_slots=32, max_len=max_len, device=dev)
torch.cuda.synchronize()
print("build_s", round(time.perf_counter() - t0, 2), flush=True)
# copy bandwidth
x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record(); [y.copy_(x) for _ in range(10)]; e.record(); torch.cuda.synchronize()
bw = 2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3)
del x, y
wbytes = model.weight_bytes()
for p in range(32):
    model(torch.randint(0, 32000, (16,), device=dev), torch.arange(16, device=dev), Prefill(slot=p))
rows = []
for bs in (1, 8, 32):
    ids = torch.randint(0, 32000, (bs,), device=dev); pos = torch.full((bs,), 16, device=dev)
    slots = torch.arange(bs, device=dev)
    step = Decode(slot_ids=slots)
    eager = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter(); model(ids, pos, step); torch.cuda.synchronize(); eager.append(time.perf_counter() - t)
    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3): out = model(ids, pos, step)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model(ids, pos, step)
    ref = model(ids, pos, step); g.replay(); torch.cuda.synchronize()
    same = torch.allclose(out.float(), ref.float(), atol=1e-2)
    for _ in range(5): g.replay()
    s.record(); n = 50
    for _ in range(n): g.replay()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / n
    floor_ms = wbytes / bw * 1e3
    rows.append(dict(batch=bs, eager_ms=round(sorted(eager)[2] * 1e3, 3), graph_ms=round(ms, 3), tok_s=round(bs / ms * 1e3, 1),
                     floor_ms=round(floor_ms, 3), frac_of_floor=round(floor_ms / ms, 3), graph_matches_eager=bool(same)))
print(json.dumps(dict(weight_GB=wbytes / 1e9, copy_GBps=bw / 1e9, max_len=max_len, torch=torch.__version__)))
print(f"{'batch':>5} {'eager_ms':>9} {'graph_ms':>9} {'tok/s':>8} {'floor_ms':>8} {'frac':>6} ok")
for r in rows:
    print(f"{r['batch']:>5} {r['eager_ms']:>9} {r['graph_ms']:>9} {r['tok_s']:>8} {r['floor_ms']:>8} {r['frac_of_floor']:>6} {r['graph_matches_eager']}")

# Where does batch-1 decode time go? Kernel count and summed kernel time from the profiler.
from torch.profiler import profile, ProfilerActivity
ids = torch.randint(0, 32000, (1,), device=dev); pos = torch.full((1,), 16, device=dev)
step = Decode(slot_ids=torch.arange(1, device=dev))
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model(ids, pos, step); torch.cuda.synchronize()
evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
tot = sum(e.device_time for e in evs)
print(f"kernels per decode step: {len(evs)}, summed kernel time {tot/1e3:.3f} ms")
by = {}
for e in evs:
    k = e.name[:60]; c, t = by.get(k, (0, 0)); by[k] = (c + 1, t + e.device_time)
for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:18]:
    print(f"{c:5d} {t/1e3:8.3f} ms  {k}")
