"""`understudy bench decode`: the engine in-process (no HTTP, weights from disk), tokens/s per batch
and, at batch 1, the fraction of the memory-bandwidth floor; the CUDA-graph and fused-kernel checks
of `validate`. ``local_engine`` serves `bench serve --offline` and the tests too."""
from __future__ import annotations

import tempfile
import time

import torch

from wire.engine_config import EngineConfig, step_token_budget
from engines.core.engine import LLMEngine
from models import read_model_args
from models.paged import sequence_meta
from engines.core.runner import ModelRunner
from engines.core.sampling import SamplingParams
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer
from engines.process.weights import RankWeights, load_rank_weights


# ---- in-process engine ------------------------------------------------------------------------
def runner_kv_bytes(model, max_len: int, max_num_seqs: int, block_size: int) -> int:  # noqa: ANN001
    """KV bytes for max_num_seqs sequences of max_len tokens, plus the padding block."""
    return model.kv_bytes_per_block(block_size) * (max_num_seqs * -(-max_len // block_size) + 1)


def local_weights(model_dir: str, device: str = "cpu", dtype: str | None = None, max_num_seqs: int = 32,
                  max_len: int = 512) -> tuple[RankWeights, EngineConfig, torch.device]:
    """The model's weights read from disk on GPU 0 or the CPU (fp32 there unless `dtype`), the engine
    config they were read with, and the device."""
    args = read_model_args(model_dir)
    dtype = dtype or ("float32" if device == "cpu" else args.torch_dtype)
    with tempfile.TemporaryDirectory() as rt:
        cfg = EngineConfig(name="bench", model_path=str(model_dir), port=0, runtime_dir=rt, device=device,
                           dtype=dtype, weight_cache_mode="off", max_num_seqs=max_num_seqs, max_model_len=max_len)
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return load_rank_weights(cfg, args, 0, dev), cfg, dev


KV_HEADROOM = 6 << 30  # GPU memory left beside a default KV cache: activations, graphs, the numerics' float32


def local_engine(model_dir: str, device: str = "cpu", dtype: str | None = None, max_num_seqs: int = 32,
                 max_len: int = 512, cuda_graphs: bool = True, fused_kernels: bool = True,
                 kv_cache_bytes: int | None = None, block_size: int = 16, max_num_batched_tokens: int | None = None,
                 prefix_caching: bool = True, deterministic: bool = False) -> LLMEngine:
    """An engine without HTTP or control channel, weights from disk (`off`), for benchmarks and tests.
    Without `kv_cache_bytes`, the cache holds max_num_seqs sequences of max_len tokens, or on a GPU what
    its free memory holds beside KV_HEADROOM (sequences beyond it wait or are preempted)."""
    weights, cfg, dev = local_weights(model_dir, device, dtype, max_num_seqs, max_len)
    runner = ModelRunner(weights.model, dev, fused_kernels=fused_kernels, deterministic=deterministic)
    if kv_cache_bytes is None:
        kv_cache_bytes = runner_kv_bytes(weights.model, max_len, max_num_seqs, block_size)
        if dev.type == "cuda":
            kv_cache_bytes = min(kv_cache_bytes, torch.cuda.mem_get_info(dev)[0] - KV_HEADROOM)
    runner.allocate_kv_cache(kv_cache_bytes, block_size, max_len, max_num_seqs,
                             max_num_batched_tokens or step_token_budget(cfg))
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

