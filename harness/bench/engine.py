"""`understudy bench decode|restart|validate`: engine benchmarks; each prints a short table.

- `decode MODEL_DIR`: tokens/s at batch 1, 8, 32 (greedy, in-process, CUDA graphs on CUDA); at
  batch 1 the fraction of the memory-bandwidth floor: (weight bytes per token / device copy
  bandwidth measured in the same run) / measured seconds per token.
- `restart MODEL_DIR`: restart-to-ready in `client` mode (a daemon holds the weights), by a cold
  `python -m engines` and by the spawn server; ready = a greedy completion answered over HTTP.
  Per-phase seconds from the engine's /startup.
- `validate`: the H200 check: make (or reuse) a checkpoint, CUDA graphs vs eager tokens, then
  both benchmarks; one summary table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from .config import EngineConfig, step_token_budget
from .engine import LLMEngine
from .launch import EngineProcess, first_completion, wait_for_ready_line
from .models import read_model_args
from .models.paged import sequence_meta
from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence
from .startup import PHASES
from .tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


# ---- in-process engine ------------------------------------------------------------------------
def runner_kv_bytes(model, max_len: int, max_num_seqs: int, block_size: int) -> int:  # noqa: ANN001
    """KV bytes for max_num_seqs sequences of max_len tokens, plus the padding block."""
    return model.kv_bytes_per_block(block_size) * (max_num_seqs * -(-max_len // block_size) + 1)


def local_engine(model_dir: str, device: str = "cpu", dtype: str | None = None, max_num_seqs: int = 32,
                 max_len: int = 512, cuda_graphs: bool = True, fused_kernels: bool = True,
                 kv_cache_bytes: int | None = None, block_size: int = 16, max_num_batched_tokens: int | None = None,
                 prefix_caching: bool = True) -> LLMEngine:
    """An engine without HTTP or control channel, weights from disk (`off`), for benchmarks and tests.
    Without `kv_cache_bytes`, the cache holds max_num_seqs sequences of max_len tokens."""
    from .weights import load_rank_weights

    args = read_model_args(model_dir)
    dtype = dtype or ("float32" if device == "cpu" else args.torch_dtype)
    with tempfile.TemporaryDirectory() as rt:
        cfg = EngineConfig(name="bench", model_path=str(model_dir), port=0, runtime_dir=rt, device=device,
                           dtype=dtype, weight_cache_mode="off", max_num_seqs=max_num_seqs, max_model_len=max_len)
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        weights = load_rank_weights(cfg, args, 0, dev)
    runner = ModelRunner(weights.model, dev, fused_kernels=fused_kernels)
    runner.allocate_kv_cache(kv_cache_bytes or runner_kv_bytes(weights.model, max_len, max_num_seqs, block_size),
                             block_size, max_len, max_num_seqs, max_num_batched_tokens or step_token_budget(cfg))
    if cuda_graphs and dev.type == "cuda":
        runner.capture_graphs()
    engine = LLMEngine(runner, Tokenizer(model_dir), max_len, max_num_seqs, prefix_caching=prefix_caching)
    engine.keepalive = weights.keepalive  # type: ignore[attr-defined]
    return engine


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large copy (each byte read once and written once)."""
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def weight_bytes_per_token(model) -> int:  # noqa: ANN001
    """Bytes of weights one decode token reads: every parameter, except that an untied embedding
    table contributes one row (tied, it is read whole as the LM head)."""
    total = model.weight_bytes()
    emb = model.model.embed_tokens.weight
    if emb is not model.lm_head.weight:
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def decode_throughput(engine: LLMEngine, batch: int, tokens: int, prompt_len: int) -> float:
    """Decode tokens/s for `batch` sequences generating `tokens` each (prefill excluded)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate(random_prompts(batch, prompt_len, engine.tokenizer.vocab_size, 99),
                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up this batch size
    seqs = [Sequence(ids, params, engine.tokenizer, set(), engine.max_model_len, lambda o: None)
            for ids in random_prompts(batch, prompt_len, engine.tokenizer.vocab_size, batch)]
    for seq in seqs:
        engine.scheduler.add(seq)
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):  # admit and prefill every sequence
        engine.step()
    _sync(engine.runner.device)
    t0, before = time.perf_counter(), sum(len(s.output_ids) + s.unread for s in seqs)
    while engine.has_work:
        engine.step()
    _sync(engine.runner.device)
    return (batch * tokens - before) / (time.perf_counter() - t0)


def bench_decode(model_dir: str, device: str, batches: list[int], tokens: int, prompt_len: int,
                 dtype: str | None, cuda_graphs: bool, fused_kernels: bool = True,
                 max_model_len: int | None = None) -> dict:
    """`max_model_len`: the engine's context (as a server's); default just what the run needs."""
    max_len = max_model_len or prompt_len + tokens + 8
    if prompt_len + tokens > max_len:
        raise ValueError(f"--prompt-len {prompt_len} + --tokens {tokens} exceeds --max-model-len {max_len}")
    engine = local_engine(model_dir, device, dtype, max_num_seqs=max(batches), max_len=max_len,
                          cuda_graphs=cuda_graphs, fused_kernels=fused_kernels)
    dev = engine.runner.device
    bandwidth = copy_bandwidth(dev)
    weight_bytes = weight_bytes_per_token(engine.runner.model)
    rows = {b: decode_throughput(engine, b, tokens, prompt_len) for b in batches}
    floor_tps = bandwidth / weight_bytes
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": str(engine.runner.model.dtype).removeprefix("torch."), "weight_bytes": weight_bytes,
              "copy_bandwidth_gbps": bandwidth / 1e9, "cuda_graphs": engine.runner.graph_sizes,
              "fused_decode": engine.runner.fused_decode_status,
              "tokens_per_s": rows, "floor_tokens_per_s_batch1": floor_tps}
    if 1 in rows:
        result["batch1_fraction_of_floor"] = rows[1] / floor_tps
    return result


def print_decode(r: dict) -> None:
    print(f"\ndecode: {r['device']}, {r['dtype']}, weight bytes read per token {r['weight_bytes'] / 1e9:.3f} GB, "
          f"copy bandwidth {r['copy_bandwidth_gbps']:.1f} GB/s, CUDA graphs {r['cuda_graphs'] or 'off'}, "
          f"fused decode kernels {r['fused_decode']}")
    print(f"{'batch':>6}{'tokens/s':>12}{'ms/step':>10}")
    for b, tps in r["tokens_per_s"].items():
        print(f"{b:>6}{tps:>12.1f}{1000 * b / tps:>10.2f}")
    if "batch1_fraction_of_floor" in r:
        print(f"batch 1: floor {r['floor_tokens_per_s_batch1']:.1f} tokens/s (weight bytes / copy bandwidth); "
              f"achieved {r['batch1_fraction_of_floor']:.1%} of it")


# ---- restart ----------------------------------------------------------------------------------
def _ready_by_canary(url: str, model: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            first_completion(url, model)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _one_restart(cfg: EngineConfig, log: Path, spawn) -> dict:  # noqa: ANN001
    """Start an engine (cold, or through `spawn`), time until a canary completion succeeds, kill it."""
    t0 = time.perf_counter()
    if spawn is None:
        proc = EngineProcess(cfg, log)
        pid, exited = proc.pid, proc.proc.poll
    else:
        pid = spawn.spawn(cfg, str(log))
        exited = lambda: spawn.wait(pid)  # noqa: E731
    try:
        ready = wait_for_ready_line(log, 300, exited)
        url = f"http://{cfg.host}:{ready['port']}"
        _ready_by_canary(url, cfg.served_model_name or Path(cfg.model_path).name, 60)
        total = time.perf_counter() - t0
        startup = httpx.get(url + "/startup").json()
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if spawn is None:
            proc.proc.wait()
        else:
            while spawn.wait(pid) is None:
                time.sleep(0.01)
    return {"ready_s": total, **startup}


def _wait_for_path(path: Path, log: Path, timeout_s: float = 120) -> None:
    """Wait until a server's socket exists (it binds after its imports)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s:.0f} s; see {log}")
        time.sleep(0.05)


def bench_restart(model_dir: str, device: str, dtype: str | None, runs: int, kv_cache_bytes: int,
                  max_num_seqs: int, work_dir: Path | None = None) -> dict:
    """Median restart-to-ready, cold exec vs spawn server; logs stay in `work_dir` (default: a temp
    dir removed on success)."""
    from daemon.runtime_dir import daemon_socket_path, ensure_private_dir
    from .spawn_client import SpawnClient

    model_dir = str(Path(model_dir).resolve())
    dtype = dtype or ("float32" if device == "cpu" else read_model_args(model_dir).torch_dtype)
    work = Path(work_dir or tempfile.mkdtemp(prefix="understudy-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rt = ensure_private_dir(work / "rt")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> subprocess.Popen:
        with open(work / log, "wb") as f:
            p = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=ROOT)
        procs.append(p)
        return p

    def cfg(name: str) -> EngineConfig:
        return EngineConfig(name=name, model_path=model_dir, port=0, runtime_dir=str(rt), device=device,
                            gpu_ids=[0] if device == "cuda" else [], dtype=dtype, weight_cache_mode="client",
                            kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs)
    results: dict[str, list[dict]] = {"cold": [], "spawn": []}
    try:
        start(["-m", "daemon", "--model", model_dir, "--rank", "0", "--device", device, "--dtype", dtype,
               "--runtime-dir", str(rt)], "daemon.log")
        start(["-m", "engines.spawn_server", "--socket", str(work / "spawn.sock")], "spawn-server.log")
        _wait_for_path(daemon_socket_path(rt, 0), work / "daemon.log")
        _wait_for_path(work / "spawn.sock", work / "spawn-server.log")
        # The first engine waits for the daemon's cold load; it is not timed.
        warm = _one_restart(cfg("warmup"), work / "warmup.log", None)
        if warm["weights_source"] != "cache_hit":
            raise RuntimeError(f"warm-up engine loaded {warm['weights_source']}, not cache_hit; see {work}")
        with SpawnClient(str(work / "spawn.sock")) as spawn:
            for i in range(runs):
                results["cold"].append(_one_restart(cfg(f"cold{i}"), work / f"cold{i}.log", None))
                results["spawn"].append(_one_restart(cfg(f"spawn{i}"), work / f"spawn{i}.log", spawn))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for mode, rs in results.items():
        summary[mode] = {"ready_s": statistics.median(r["ready_s"] for r in rs),
                         "phases": {p: statistics.median(r["phases"][p] for r in rs) for p in PHASES},
                         "weights_source": sorted({r["weights_source"] for r in rs})}
    return {"device": device, "dtype": dtype, "runs": runs, "modes": summary}


def print_restart(r: dict) -> None:
    print(f"\nrestart to ready (client mode, median of {r['runs']}, {r['device']} {r['dtype']}):")
    head = "".join(f"{p:>14}" for p in PHASES)
    print(f"{'mode':<8}{'ready_s':>9}{head}  source")
    for mode, s in r["modes"].items():
        cells = "".join(f"{s['phases'][p]:>14.3f}" for p in PHASES)
        print(f"{mode:<8}{s['ready_s']:>9.3f}{cells}  {','.join(s['weights_source'])}")


# ---- validate (H200) --------------------------------------------------------------------------
def graphs_match_eager(model_dir: str, device: str, dtype: str | None = None,
                       tokens: int = 32) -> tuple[dict[str, bool], list[int]]:
    """Greedy tokens for batches 1, 3 and 8 through CUDA graphs equal the eager ones, with the
    fused decode kernels and without; returns ({"torch": ok, "fused": ok}, graph sizes)."""
    prompts_all = random_prompts(8, 16, Tokenizer(model_dir).vocab_size, 5)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ok, sizes = {}, []
    for fused in (False, True):
        outs = []
        for graphs in (False, True):
            engine = local_engine(model_dir, device, dtype, max_num_seqs=8, max_len=64, cuda_graphs=graphs,
                                  fused_kernels=fused)
            sizes = engine.runner.graph_sizes if engine.runner.graphs else sizes
            outs.append([engine.generate(prompts_all[:b], params) for b in (1, 3, 8)])
            del engine
        ok["fused" if fused else "torch"] = outs[0] == outs[1]
    return ok, sizes


def fused_logit_error(model_dir: str, device: str, dtype: str | None = None, steps: int = 32) -> dict:
    """Accuracy of the fused decode kernels: four prompts decoded at batch 1, teacher-forced along
    float32 greedy tokens; for the torch path and for the kernels (both in `dtype`), the largest
    logit error against float32 relative to the largest logit, and how often the argmax agrees."""
    ref = local_engine(model_dir, device, "float32", max_num_seqs=1, max_len=16 + steps + 1, cuda_graphs=False)
    engine = local_engine(model_dir, device, dtype, max_num_seqs=1, max_len=16 + steps + 1, cuda_graphs=False)
    model = engine.runner.model
    if not model.use_fused_decode:
        return {"skipped": engine.runner.fused_decode_status}
    err = {"torch": 0.0, "fused": 0.0}
    agree = {"torch": 0, "fused": 0}
    dev, bs = engine.runner.device, engine.runner.block_size
    table = list(range(1, engine.runner.max_blocks + 1))  # block 0 is the padding block
    for prompt in random_prompts(4, 16, engine.tokenizer.vocab_size, 11):
        ids, pos = torch.tensor(prompt, device=dev), torch.arange(16, device=dev)
        meta = sequence_meta(table, 0, 16, bs, dev)
        ids = ref.runner.model(ids, pos, meta)[-1:].argmax(-1)
        engine.runner.model(torch.tensor(prompt, device=dev), pos, meta)
        for step in range(steps):
            pos = torch.full((1,), 16 + step, device=dev)
            meta = sequence_meta(table, 16 + step, 1, bs, dev)
            want = ref.runner.model(ids, pos, meta).float()
            for path in ("torch", "fused"):  # both write the same KV rows: one shared history
                model.use_fused_decode = path == "fused"
                got = model(ids, pos, meta).float()
                err[path] = max(err[path], ((got - want).abs().max() / want.abs().max()).item())
                agree[path] += int(got.argmax(-1) == want.argmax(-1))
            ids = want.argmax(-1)
    tokens = 4 * steps
    return {"torch_vs_fp32": err["torch"], "fused_vs_fp32": err["fused"], "tokens": tokens,
            "torch_argmax_agreement": agree["torch"] / tokens, "fused_argmax_agreement": agree["fused"] / tokens}


def fused_as_accurate(err: dict) -> bool:
    """The kernels' error against float32 is within 25% of the torch path's (or skipped)."""
    return "skipped" in err or err["fused_vs_fp32"] <= 1.25 * err["torch_vs_fp32"] + 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="understudy bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    dev_default = "cuda" if torch.cuda.is_available() else "cpu"
    d = sub.add_parser("decode", help="decode tokens/s at batch 1, 8, 32 and the batch-1 bandwidth floor")
    d.add_argument("model_dir")
    d.add_argument("--batches", default="1,8,32")
    d.add_argument("--tokens", type=int, default=128)
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's context, as a server's (default: prompt-len + tokens + 8)")
    r = sub.add_parser("restart", help="restart-to-ready in client mode, cold vs spawn server, per phase")
    r.add_argument("model_dir")
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--kv-cache-gb", type=float, default=1.0)
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--work-dir", type=Path, default=None, help="keep logs here (default: temp, removed)")
    v = sub.add_parser("validate", help="H200 check: CUDA graphs vs eager, then decode and restart benchmarks")
    v.add_argument("--model-dir", default=None, help="checkpoint to use (default: make the 1b preset in a temp dir)")
    v.add_argument("--preset", default="1b")
    v.add_argument("--runs", type=int, default=3)
    for p in (d, r, v):
        p.add_argument("--device", choices=["cpu", "cuda"], default=dev_default)
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
        p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    d.add_argument("--no-cuda-graphs", action="store_true")
    d.add_argument("--no-fused-kernels", action="store_true", help="decode through the torch path only")
    ns = parser.parse_args(argv)

    if ns.cmd == "decode":
        res = bench_decode(ns.model_dir, ns.device, [int(b) for b in ns.batches.split(",")], ns.tokens,
                           ns.prompt_len, ns.dtype, not ns.no_cuda_graphs, not ns.no_fused_kernels,
                           ns.max_model_len)
        print_decode(res)
    elif ns.cmd == "restart":
        res = bench_restart(ns.model_dir, ns.device, ns.dtype, ns.runs, int(ns.kv_cache_gb * (1 << 30)),
                            ns.max_num_seqs, ns.work_dir)
        print_restart(res)
    else:
        res = validate(ns)
    if ns.json:
        print(json.dumps(res, default=str))
    return 0 if res.get("ok", True) else 1


def validate(ns: argparse.Namespace) -> dict:
    from .make_model import make_model

    model_dir = ns.model_dir
    if model_dir is None:
        model_dir = str(Path(tempfile.gettempdir()) / f"understudy-bench-{ns.preset}")
        if not (Path(model_dir) / "config.json").exists():
            print(f"making the {ns.preset} checkpoint in {model_dir} ...", flush=True)
            make_model(model_dir, ns.preset)
    t0 = time.perf_counter()
    same, sizes = graphs_match_eager(model_dir, ns.device, ns.dtype)
    print(f"CUDA graphs {sizes or 'off (no CUDA)'}: tokens equal eager: {same} ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    ok = all(same.values())
    fused = fused_logit_error(model_dir, ns.device, ns.dtype)
    print(f"logit error against float32, teacher-forced: {fused}", flush=True)
    ok = ok and fused_as_accurate(fused)
    unfused = bench_decode(model_dir, ns.device, [1, 8, 32], 128, 64, ns.dtype, True, fused_kernels=False)
    print_decode(unfused)
    dec = bench_decode(model_dir, ns.device, [1, 8, 32], 128, 64, ns.dtype, True)
    print_decode(dec)
    rst = bench_restart(model_dir, ns.device, ns.dtype, ns.runs, 1 << 30, 16)
    print_restart(rst)
    spawn, cold = rst["modes"]["spawn"], rst["modes"]["cold"]
    rows = [
        ("CUDA graphs == eager tokens", "yes" if all(same.values()) else "NO", f"must be yes: {same}"),
        ("logit error vs fp32, fused", f"{fused.get('fused_vs_fp32', float('nan')):.2%}",
         f"torch path {fused.get('torch_vs_fp32', float('nan')):.2%}; must be within 25% of it"),
        ("decode batch 1 (tokens/s)", f"{dec['tokens_per_s'][1]:.1f}", ""),
        ("decode batch 8 (tokens/s)", f"{dec['tokens_per_s'][8]:.1f}", ""),
        ("decode batch 32 (tokens/s)", f"{dec['tokens_per_s'][32]:.1f}", ""),
        ("batch 1 / floor, no kernels", f"{unfused['batch1_fraction_of_floor']:.1%}", unfused["fused_decode"]),
        ("batch 1 / bandwidth floor", f"{dec['batch1_fraction_of_floor']:.1%}", "target >= 60%; " + dec["fused_decode"]),
        ("restart cold exec (s)", f"{cold['ready_s']:.3f}", ",".join(cold["weights_source"])),
        ("restart spawn server (s)", f"{spawn['ready_s']:.3f}", "target <= 2 s; " + ",".join(spawn["weights_source"])),
    ]
    print(f"\n{'check':<30}{'value':>12}  note")
    for name, value, note in rows:
        print(f"{name:<30}{value:>12}  {note}")
    return {"ok": ok, "model_dir": model_dir, "graph_sizes": sizes, "fused_vs_torch": fused, "decode": dec,
            "decode_unfused": unfused,
            "restart": rst}


if __name__ == "__main__":
    sys.exit(main())
