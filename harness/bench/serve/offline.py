"""In-process mode: the engine without HTTP (harness.bench.decode.local_engine), every request submitted
at once to its scheduler loop; per-request output lengths, timings taken from its callbacks."""
from __future__ import annotations

import sys
import threading
import time

from harness.load.result import RequestResult, Usage

from .workloads import RequestSpec


def run_offline(model_dir: str, specs: list[RequestSpec], device: str, dtype: str | None, max_model_len: int,
                max_num_seqs: int, cuda_graphs: bool, fused_kernels: bool, temperature: float,
                ignore_eos: bool, timeout_s: float) -> tuple[list[RequestResult], float, dict]:
    """(results, seconds from the first submit to the last finish, engine facts)."""
    from harness.bench.decode import local_engine
    from engines.core.sampling import SamplingParams

    print(f"bench serve: offline engine {model_dir} on {device}, max_model_len {max_model_len}, "
          f"max_num_seqs {max_num_seqs}", file=sys.stderr, flush=True)
    engine = local_engine(model_dir, device, dtype, max_num_seqs=max_num_seqs, max_len=max_model_len,
                          cuda_graphs=cuda_graphs, fused_kernels=fused_kernels)
    warm = specs[:min(len(specs), 8)]
    engine.generate([s.prompt for s in warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    results = [RequestResult(path="(in-process)", stream=True, sent=0.0) for _ in specs]
    left = [len(specs)]
    finished = threading.Event()
    lock = threading.Lock()

    def emitter(r: RequestResult):
        def emit(out) -> None:  # noqa: ANN001  (engines.core.sequence.Output, on the loop thread)
            now = time.perf_counter()
            if out.delta or out.finish_reason is not None:
                r.content_times.append(now)
            if out.finish_reason is not None:
                r.end = now
                r.usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
                if out.finish_reason not in ("stop", "length"):
                    r.failure, r.error = "cut", f"finished with {out.finish_reason!r}"
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()
        return emit

    engine.start()
    try:
        t0 = time.perf_counter()
        for s, r in zip(specs, results):
            params = SamplingParams(max_tokens=s.max_tokens, temperature=temperature, ignore_eos=ignore_eos)
            engine.submit(s.prompt, params, emitter(r))
        for r in results:  # (all count as sent at t0)
            r.sent = t0
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
        if r.end is None:
            r.failure, r.error = "cut", "never finished"
    dev = engine.runner.device
    facts = {"model_dir": model_dir, "device": str(dev), "dtype": str(engine.runner.model.dtype).removeprefix("torch."),
             "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
    return results, elapsed, facts
