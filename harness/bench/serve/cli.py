"""A load generator for an OpenAI endpoint (the router by default).

`understudy bench serve` runs a closed loop: N clients each send the next request when their
previous one is done, streaming, so time to first token (TTFT) and inter-token latency (ITL: gaps
between content chunks) are seen as a client sees them. Prompts are token ids of exact lengths on
/v1/completions (random ids, seeded; no tokenizer), `ignore_eos` on, greedy by default; output
tokens are counted from the final `usage` chunk (`stream_options.include_usage`), else from content
chunks (the report says which). After the sweep, the engine's static decode (`harness.bench.engine
decode`, same checkpoint, device, dtype, max_model_len and kernels) runs at each point's batch, and
each point gets the ratio live output tok/s / static tok/s. Prefix-cache hit rate per point comes
from the Prometheus counters (supervisor admin /metrics, `--metrics-url`, or the endpoint's own
/metrics); "n/a" when they are not found.

Workloads: chat (prompts 64-512 tokens, 128 out), nano (256 requests, in and out uniform in
100-1024, all at once), shared-prefix (one 1,500-token prefix + 32 tokens, 128 out).

Exit status: 0 every request succeeded; 1 some failed (a refused connection, a non-200 answer, an
error event, a stream cut without [DONE]; the report counts them and shows samples); 2 bad options
or a target that cannot be measured as asked.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

from .point import request_body, run_point
from .metrics import prefix_delta, scrape
from .report import Report, table, write
from .stats import summarize
from .target import Target, TargetError, note, resolve, vocab_of
from .workloads import WORKLOADS, Lengths, RequestSpec, Workload, make_requests, random_ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy bench serve", description=__doc__.split("\n\n")[0],
                                epilog="Example: understudy bench serve -c configs/h200-1b.yaml --workload chat "
                                       "--out bench/serve-chat", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="chat",
                   help="chat: prompts 64-512, 128 out; nano: 256 requests at once, 100-1024 in and out; "
                        "shared-prefix: a 1,500-token prefix + 32, 128 out (%(default)s)")
    t = p.add_argument_group("target (default: the router of the config's supervisor)")
    t.add_argument("-c", "--config", help="supervisor config: router URL, admin API (model, /metrics), engine settings")
    t.add_argument("--url", help="base URL of any OpenAI endpoint (overrides the config's router)")
    t.add_argument("--model", help="model name to send (default: GET /v1/models)")
    t.add_argument("--metrics-url", help="a Prometheus page with the prefix-cache counters (e.g. an engine's /metrics)")
    t.add_argument("--vocab", type=int, help="token ids are drawn below this (default: the checkpoint's vocab_size)")
    t.add_argument("--max-model-len", type=int, help="the target's context (default: /v1/models or the config)")
    s = p.add_argument_group("static decode (same run, after the sweep)")
    s.add_argument("--model-dir", help="checkpoint folder (default: the supervisor's, from its admin API)")
    s.add_argument("--device", choices=["cpu", "cuda"], help="default: the supervisor's")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the config's")
    s.add_argument("--max-num-seqs", type=int, help="the engine's batch cap: static batch = min(concurrency, this)")
    s.add_argument("--no-cuda-graphs", action="store_true", help="static decode without CUDA graphs")
    s.add_argument("--no-fused-kernels", action="store_true", help="static decode through the torch path only")
    s.add_argument("--no-static", action="store_true", help="skip the static decode")
    s.add_argument("--static-timeout", type=float, default=1800.0, help="seconds the static decode may take")
    w = p.add_argument_group("load")
    w.add_argument("--concurrency", help="comma-separated sweep, e.g. 1,8,32 (default: the workload's)")
    w.add_argument("--num-requests", type=int,
                   help="requests per point (default: nano 256; else 8 x concurrency, within 32..1024)")
    w.add_argument("--duration", type=float, help="also stop sending after this many seconds per point")
    w.add_argument("--input-len", help="prompt tokens N or LO:HI, after any shared prefix (default: the workload's)")
    w.add_argument("--output-len", help="output tokens N or LO:HI (default: the workload's)")
    w.add_argument("--prefix-len", type=int, help="shared prefix tokens (default: the workload's)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (%(default)s: greedy)")
    w.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    w.add_argument("--seed", type=int, default=0, help="the prompts' and lengths' random ids (%(default)s)")
    w.add_argument("--warmup", type=int, default=4, help="short requests before the sweep, not counted")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds any one read may wait")
    w.add_argument("--client-procs", type=int, default=1,
                   help="spread each point's workers over this many client processes (when one is the limit: "
                        "see client_cpu in the report)")
    p.add_argument("--offline", metavar="MODEL_DIR",
                   help="no HTTP: the engine in this process, every request at once (for nano)")
    p.add_argument("--out", type=Path, help="write bench-serve.json and bench-serve.png here")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
    return p


def workload_from(args: argparse.Namespace, p: argparse.ArgumentParser) -> Workload:
    w = WORKLOADS[args.workload]
    try:
        inp = Lengths.parse(args.input_len, "--input-len") if args.input_len else w.input_len
        out = Lengths.parse(args.output_len, "--output-len") if args.output_len else w.output_len
    except ValueError as e:
        p.error(str(e))
    try:
        conc = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else w.concurrency
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if any(c < 1 for c in conc):
        p.error(f"--concurrency: expected integers >= 1, got {args.concurrency}")
    prefix = w.prefix_len if args.prefix_len is None else args.prefix_len
    if prefix < 0:
        p.error("--prefix-len: expected >= 0")
    return Workload(w.name, inp, out, prefix, conc, w.all_at_once and not args.concurrency, w.default_requests)


def requests_for(w: Workload, args: argparse.Namespace, concurrency: int) -> int:
    if args.num_requests is not None:
        return args.num_requests
    if w.default_requests is not None:
        return w.default_requests
    return max(32, min(8 * concurrency, 1024))


def check_fits(w: Workload, max_model_len: int | None, notes: list[str]) -> None:
    if max_model_len is None:
        notes.append("max_model_len unknown: requests that do not fit will be refused by the target")
    elif w.max_total_len > max_model_len:
        raise TargetError(f"workload {w.name}: prompt up to {w.prefix_len + w.input_len.hi} + output up to "
                          f"{w.output_len.hi} = {w.max_total_len} tokens exceeds max_model_len {max_model_len}; "
                          f"serve with a larger engines.max_model_len or shorten --input-len/--output-len")


def live(args: argparse.Namespace, w: Workload) -> Report:
    started = _now()
    t = resolve(args)
    for n in t.notes:
        note(n)
    if t.vocab is None:
        raise TargetError("vocab unknown (no checkpoint folder from the admin API): give --vocab or --model-dir")
    notes = list(t.notes)
    check_fits(w, t.max_model_len, notes)
    ignore_eos = not args.no_ignore_eos
    note(f"target {t.url}, model {t.model}, max_model_len {t.max_model_len}, vocab {t.vocab}; workload {w.name}: "
         f"input {w.input_len}{f' + prefix {w.prefix_len}' if w.prefix_len else ''}, output {w.output_len}")
    conc = [requests_for(w, args, 0)] if w.all_at_once else list(w.concurrency)
    if args.warmup:
        import random
        rng = random.Random(args.seed - 1)
        warm = [request_body(t.model, RequestSpec(random_ids(rng, 16, t.vocab), 4), 0.0, True)
                for _ in range(args.warmup)]
        res, _ = run_point(t.url, warm, min(args.warmup, max(conc)), args.timeout)
        bad = [r.error for r in res if not r.ok]
        if bad:
            notes.append(f"warm-up: {len(bad)} of {len(res)} failed, e.g. {bad[0]}")
            note(notes[-1])
    points = []
    for k, c in enumerate(conc):
        n = requests_for(w, args, c)
        specs = make_requests(w, n, t.vocab, args.seed + 7919 * (k + 1))
        bodies = [request_body(t.model, s, args.temperature, ignore_eos) for s in specs]
        note(f"point {k + 1}/{len(conc)}: concurrency {c}, {n} requests")
        before = scrape(t.metrics_sources)
        cpu0 = time.process_time()
        results, elapsed = run_point(t.url, bodies, c, args.timeout, args.duration, args.client_procs,
                                     label=f"concurrency {c}: ")
        point = summarize(c, results, elapsed)
        if args.client_procs == 1:  # the CPU of child processes is not counted here
            point.client_cpu = round((time.process_time() - cpu0) / elapsed, 3) if elapsed > 0 else None
        if point.client_cpu and point.client_cpu > 0.8:
            notes.append(f"concurrency {c}: the client used {point.client_cpu:.0%} of a core; its figures may be "
                         f"limited by the client itself")
            note(notes[-1])
        if before is not None and any(u == before[0] and h for u, h in t.metrics_sources):
            time.sleep(t.admin_metrics_lag_s)  # the supervisor's counters come with heartbeats
        point.prefix_cache = prefix_delta(before, scrape(t.metrics_sources))
        note(f"  concurrency {c}: {point.ok} ok, {point.errors} errors, {point.output_tok_s:.1f} output tok/s, "
             f"TTFT p50 {point.ttft_ms.p50 if point.ttft_ms else '-'} ms")
        points.append(point)
    static = static_for(args, t, w, points, notes)
    return Report(mode="live", workload=w.name, input_len=str(w.input_len), output_len=str(w.output_len),
                  prefix_len=w.prefix_len, url=t.url, model=t.model, max_model_len=t.max_model_len,
                  requests_per_point=args.num_requests, temperature=args.temperature, ignore_eos=ignore_eos,
                  started=started, points=points, static=static, notes=notes)


def static_for(args: argparse.Namespace, t: Target, w: Workload, points: list, notes: list[str]) -> dict:
    from .static import run_static, static_batches
    if args.no_static:
        return {"skipped": "--no-static"}
    if not t.model_dir:
        return {"skipped": "no checkpoint folder: give --model-dir (or -c with the supervisor running)"}
    batch_of = static_batches([p.concurrency for p in points], t.max_num_seqs)
    try:
        res = run_static(t, sorted(set(batch_of.values())), round(w.output_len.mean), w.mean_prompt_len,
                         args.static_timeout)
    except (RuntimeError, OSError) as e:
        notes.append(f"static decode failed: {e}")
        note(notes[-1])
        return {"error": str(e)}
    for p in points:
        p.static_batch = batch_of[p.concurrency]
        p.static_tok_s = round(res["tokens_per_s"][p.static_batch], 2)
        p.ratio_to_static = round(p.output_tok_s / p.static_tok_s, 6) if p.static_tok_s else None
    return res


def offline(args: argparse.Namespace, w: Workload) -> Report:
    from .offline import run_offline
    started, model_dir = _now(), args.offline
    vocab = args.vocab or vocab_of(model_dir)
    n = requests_for(w, args, 0)
    max_len = args.max_model_len or w.max_total_len
    check_fits(w, max_len, [])
    if args.device:
        device = args.device
    else:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = make_requests(w, n, vocab, args.seed + 7919)
    results, elapsed, facts = run_offline(model_dir, specs, device, args.dtype, max_len, args.max_num_seqs or n,
                                          not args.no_cuda_graphs, not args.no_fused_kernels, args.temperature,
                                          not args.no_ignore_eos, args.timeout)
    point = summarize(n, results, elapsed)
    return Report(mode="offline", workload=w.name, input_len=str(w.input_len), output_len=str(w.output_len),
                  prefix_len=w.prefix_len, url=None, model=model_dir, max_model_len=max_len, requests_per_point=n,
                  temperature=args.temperature, ignore_eos=not args.no_ignore_eos, started=started, points=[point],
                  static={"skipped": "offline mode"}, notes=[f"engine: {json.dumps(facts)}"])


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests: expected >= 1")
    if args.client_procs < 1:
        p.error("--client-procs: expected >= 1")
    w = workload_from(args, p)
    try:
        report = offline(args, w) if args.offline else live(args, w)
    except (TargetError, ValueError) as e:
        print(f"understudy bench serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the offline engine failed
        print(f"understudy bench serve: {e}", file=sys.stderr)
        return 1
    report.total_errors = sum(pt.errors for pt in report.points)
    if args.out:
        js, png = write(report, args.out)
        note(f"wrote {js} and {png}" if png else f"wrote {js} (no picture: matplotlib is the harness extra)")
    print(report.model_dump_json(indent=2) if args.json else table(report), flush=True)
    return 1 if report.total_errors else 0
