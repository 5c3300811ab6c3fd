"""Probe (GPU): the fused decode kernels against the torch path, on the 1b preset's shapes with
random bf16 weights (no checkpoint). Prints, in order:
1. agreement of logits, greedy tokens and KV writes, fused vs torch, at batch 1;
2. a tile sweep of the fused matrix-vector kernel for each of the model's five linears (µs, GB/s),
   with cuBLAS (F.linear) beside it (small weights stay in L2 across repeats: optimistic there);
3. the attention kernel against context length;
4. one decode step captured in a CUDA graph, fused vs torch: ms and fraction of the bandwidth floor;
5. where the fused batch-1 step's time goes: torch.profiler over graph replays, per kernel.
Usage: PYTHONPATH=. python3 bench/probes/fused_decode_probe.py
"""
import torch
import torch.nn.functional as F
import triton

from engines.bench import copy_bandwidth
from engines.kernels import gemv as L
from engines.kernels.attention import decode_attention
from engines.make_model import ARCHS, PRESETS
from engines.models import Decode, ModelArgs, Prefill, build_model
from engines.models.fused_decode import fused_decode

dev = torch.device("cuda")
cfg = dict(PRESETS["1b"]); cfg.update(arch=ARCHS["llama"], head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
args = ModelArgs.model_validate(cfg)
model = build_model(args, dtype=torch.bfloat16).to_empty(device=dev)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.init_buffers()
SLOTS, MAX_LEN, PROMPT = 33, 4352, 64
model.allocate_kv_cache(SLOTS, MAX_LEN, dev)
for s in range(SLOTS):
    model(torch.randint(0, 32000, (PROMPT,), device=dev), torch.arange(PROMPT, device=dev), Prefill(slot=s))


def graph_ms(fn, reps=20, replays=10):
    """Milliseconds per call of fn, captured `reps` times in one CUDA graph (launch gaps included)."""
    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / (reps * replays)


bw = copy_bandwidth(dev)  # the bench's definition: a 2 GiB device copy, read + write
floor_ms = model.weight_bytes() / bw * 1e3 - 32000 * 2048 * 2 / bw * 1e3  # embedding: one row read
print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weight bytes per token {(floor_ms * bw / 1e3) / 1e9:.3f} GB; "
      f"floor {floor_ms:.3f} ms", flush=True)

print("\n# 1. fused vs torch (eager)")
kv0 = model.kv_cache.clone()
for bs in (1,):
    ids = torch.randint(0, 32000, (bs,), device=dev); pos = torch.full((bs,), PROMPT, device=dev)
    pos[0] = 7  # a sequence with a short history too
    slots = torch.arange(bs, device=dev)
    model.kv_cache.copy_(kv0)
    ref = model(ids, pos, Decode(slots)).float(); kv_ref = model.kv_cache.clone()
    model.kv_cache.copy_(kv0)
    out = fused_decode(model, ids, pos, slots).float()
    print(f"batch {bs:>2}: max |logit diff| {(out - ref).abs().max().item():.4f} (|logit| max "
          f"{ref.abs().max().item():.2f}), argmax equal {torch.equal(out.argmax(-1), ref.argmax(-1))}, "
          f"max |KV diff| {(model.kv_cache.float() - kv_ref.float()).abs().max().item():.4f}", flush=True)
model.kv_cache.copy_(kv0)

print("\n# 2. linear tile sweep (us per call in a graph; GB/s of weight read)")
layer = model.model.layers[0]
shapes = {"qkv": (layer.self_attn.qkv_proj.weight, dict(norm_weight=layer.input_layernorm.weight)),
          "o_proj": (layer.self_attn.o_proj.weight, dict(residual=True)),
          "gate_up": (layer.mlp.gate_up_proj.weight, dict(norm_weight=layer.post_attention_layernorm.weight)),
          "down": (layer.mlp.down_proj.weight, dict(gated=True, residual=True)),
          "lm_head": (model.lm_head.weight, dict(norm_weight=model.model.norm.weight))}
configs = [(4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 8),
           (16, 1024, 8), (32, 256, 8)]
orig_tiles = L.tile_sizes
for name, (w, kw) in shapes.items():
    n, k = w.shape
    xin = torch.randn(1, 2 * k if kw.get("gated") else k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, n, device=dev, dtype=torch.bfloat16) if kw.get("residual") else None
    call_kw = {**kw, "residual": res}
    cublas = graph_ms(lambda: F.linear(xin[:, :k], w)) * 1e3
    row = [f"{name:>8} N={n} K={k}: cuBLAS {cublas:5.1f}us {w.numel() * 2 / cublas / 1e3:4.0f}GB/s |"]
    times = {}
    default = orig_tiles(n, k)
    for cfg in dict.fromkeys(configs + [default]):
        L.tile_sizes = lambda n_, k_, cfg=cfg: cfg
        us = graph_ms(lambda: L.fused_gemv(xin, w, **call_kw)) * 1e3
        times[cfg] = us
        row.append(f" {cfg[0]}x{cfg[1]}w{cfg[2]}:{us:.1f}")
    L.tile_sizes = orig_tiles
    cfg, us = min(times.items(), key=lambda t: t[1])
    row.append(f" | best {cfg} {us:.1f}us {w.numel() * 2 / us / 1e3:.0f}GB/s; default {default} {times[default]:.1f}us")
    print("".join(row), flush=True)

print("\n# 3. attention kernel (us per call in a graph), batch x context")
attn = layer.self_attn
for bs, ctx in ((1, 64), (1, 192), (1, 1024), (1, 4000), (4, 192), (16, 1024)):
    qkv = torch.randn(bs, (attn.heads + 2 * attn.kv_heads) * attn.head_dim, device=dev, dtype=torch.bfloat16)
    pos = torch.full((bs,), ctx, device=dev); slots = torch.arange(bs, device=dev)
    cos, sin = model.model.rope_cos[pos], model.model.rope_sin[pos]
    us = graph_ms(lambda: decode_attention(qkv, model.kv_cache[0], cos, sin, slots, pos, attn.heads, attn.kv_heads)) * 1e3
    print(f"batch {bs:>2} context {ctx:>5}: {us:6.1f} us", flush=True)
model.kv_cache.copy_(kv0)

print("\n# 4. decode step in a CUDA graph (context 64)")
print(f"{'path':<8}{'batch':>6}{'ms':>8}{'tok/s':>9}{'floor frac':>11}")
for fused in (False, True):
    model.use_fused_decode = fused
    for bs in (1, 2, 8):
        ids = torch.randint(0, 32000, (bs,), device=dev); pos = torch.full((bs,), PROMPT, device=dev)
        slots = torch.arange(bs, device=dev)
        ms = graph_ms(lambda: model(ids, pos, Decode(slots)), reps=5)
        print(f"{'fused' if fused else 'torch':<8}{bs:>6}{ms:>8.3f}{bs / ms * 1e3:>9.0f}{floor_ms / ms:>11.1%}", flush=True)
        model.kv_cache.copy_(kv0)

print("\n# 5. fused batch-1 step: kernel time by kernel (torch.profiler over 20 graph replays)")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

model.use_fused_decode = True
ids = torch.randint(0, 32000, (1,), device=dev); pos = torch.full((1,), PROMPT, device=dev)
slots = torch.zeros(1, dtype=torch.long, device=dev)
step = Decode(slots)
for _ in range(2):
    model(ids, pos, step)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    model(ids, pos, step)
g.replay(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
rows = {}
events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
for e in events:
    r = rows.setdefault(e.name[:60], [0, 0.0])
    r[0] += 1; r[1] += e.time_range.elapsed_us()
busy = sum(r[1] for r in rows.values()) / 20
span = (events[-1].time_range.end - events[0].time_range.start) / 20 if events else 0
print(f"{len(events) / 20:.0f} kernels per step; kernel time {busy:.1f} us per step; first start to last end "
      f"{span:.1f} us per step (gaps {span - busy:.1f} us)")
for name, (count, us) in sorted(rows.items(), key=lambda t: -t[1][1]):
    print(f"{name:<60}{count / 20:>6.0f}/step{us / 20:>10.1f} us/step{us / count:>8.2f} us each")
