"""In-process mode: the engine without HTTP (harness.bench.decode.local_engine), every request submitted
at once to its scheduler loop; per-request output lengths, timings taken from its callbacks."""
from __future__ import annotations

import sys
import threading
import time

from .client import RequestResult
from .workloads import RequestSpec


def run_offline(model_dir: str, specs: list[RequestSpec], device: str, dtype: str | None, max_model_len: int,
                max_num_seqs: int, cuda_graphs: bool, fused_kernels: bool, temperature: float,
                ignore_eos: bool, timeout_s: float) -> tuple[list[RequestResult], float, dict]:
    """(results, seconds from the first submit to the last finish, engine facts)."""
    from harness.bench.decode import local_engine
    from engines.sampling import SamplingParams

    print(f"bench serve: offline engine {model_dir} on {device}, max_model_len {max_model_len}, "
          f"max_num_seqs {max_num_seqs}", file=sys.stderr, flush=True)
    engine = local_engine(model_dir, device, dtype, max_num_seqs=max_num_seqs, max_len=max_model_len,
                          cuda_graphs=cuda_graphs, fused_kernels=fused_kernels)
    warm = specs[:min(len(specs), 8)]
    engine.generate([s.prompt for s in warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    results = [RequestResult(False) for _ in specs]
    last = [0.0] * len(specs)
    left = [len(specs)]
    finished = threading.Event()
    lock = threading.Lock()

    def emitter(i: int, t0: float):
        r = results[i]

        def emit(out) -> None:  # noqa: ANN001  (engines.sequence.Output, on the loop thread)
            now = time.perf_counter()
            if out.delta or out.finish_reason is not None:
                if r.ttft is None:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last[i])
                last[i] = now
                r.chunks += 1
            if out.finish_reason is not None:
                r.latency, r.output_tokens, r.prompt_tokens = now - t0, out.completion_tokens, out.prompt_tokens
                r.usage_reported = True
                r.ok = out.finish_reason in ("stop", "length")
                r.error = None if r.ok else f"finished with {out.finish_reason!r}"
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()
        return emit

    engine.start()
    try:
        t0 = time.perf_counter()
        for i, s in enumerate(specs):
            params = SamplingParams(max_tokens=s.max_tokens, temperature=temperature, ignore_eos=ignore_eos)
            engine.submit(s.prompt, params, emitter(i, t0))
        deadline = t0 + timeout_s
        while not finished.wait(0.2):
            if engine.stopped.is_set():
                raise RuntimeError("offline run: the engine's scheduler loop stopped (see the log above)")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"offline run: {left[0]} of {len(specs)} requests unfinished after "
                                   f"{timeout_s:.0f} s")
        elapsed = max(r.latency for r in results)
    finally:
        engine.stop()
    for r in results:
        if r.error is None and not r.ok:
            r.error = "never finished"
    dev = engine.runner.device
    facts = {"model_dir": model_dir, "device": str(dev), "dtype": str(engine.runner.model.dtype).removeprefix("torch."),
             "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
    return results, elapsed, facts
