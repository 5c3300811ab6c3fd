#!/usr/bin/env bash
# Deterministic serving (issue 21) on one H200 (device tool), the 1b preset in bf16:
#   bash bench/gpu_deterministic.sh check  # (1) bench/probes/deterministic.py: linear, rms_norm, attention
#                                          #     prefill vs decode vs chunks, the model's logits alone vs in
#                                          #     batches of 2..256: bit-identical yes/no and max |diff| per case,
#                                          #     deterministic vs default; (2) the deterministic tests natively
#                                          #     (tests/models/test_invariant_ops.py, test_deterministic_model.py,
#                                          #     -m gpu included); (3) understudy bench determinism: 32 prompts
#                                          #     greedy + seeded alone, then 32 streaming clients for DURATION s
#                                          #     (45) without and with KILLS (15) SIGKILLs of the primary
#   bash bench/gpu_deterministic.sh ab     # (4) throughput A/B: a deterministic node (8000/8001) and a default
#                                          #     one (8100/8101) at once on GPU 0 (16 GiB pools each), bench serve
#                                          #     chat:32, nano:256 and chat:1 (batch-1 inter-token latency) on each
#                                          #     in turn (ABBA, RUNS=2 of DURATION=10 s), medians, then the ratios
#   bash bench/gpu_deterministic.sh tune   # (5) bench/probes/invariant_tune.py: the products' launch configurations
#                                          #     (time, invariance) and a step's kernels, default vs deterministic
#   bash bench/gpu_deterministic.sh all    # check, then ab: about 12 minutes, over one device call's 10, so run
#                                          # check and ab as two calls (about 7 and 6 minutes)
# Logs go to $OUT; the last lines printed are the figures.
source bench/gpu_env.sh
config() {  # config NAME PORT DETERMINISTIC KV_BYTES: the h200 config on $M, its own ports, dirs and mode
  sed "s#preset: 1b#path: $M#; s#port: 8000#port: $2#; s#port: 8001#port: $(($2 + 1))#" configs/h200-1b.yaml \
    | sed "s#kv_cache_bytes: .*#kv_cache_bytes: $4\n  deterministic: $3#" > /tmp/$1.yaml
  printf 'runtime_dir: /tmp/rt-%s\ncache_dir: /tmp/cache-%s\n' "$1" "$1" >> /tmp/$1.yaml
}
check() {
  echo "== (1) probe"
  timeout 200 python3 bench/probes/deterministic.py $M --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt"
  echo "== (2) tests"
  timeout 150 python3 -m pytest -q tests/models/test_invariant_ops.py \
    tests/models/test_deterministic_model.py 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.log"
  echo "== (3) bench determinism"
  config det 8000 true 34359738368
  timeout 330 python3 -m supervisor.cli bench determinism -c /tmp/det.yaml --prompts 32 --clients 32 \
    --max-tokens ${MAX_TOKENS:-64} --duration ${DURATION:-45} --kills ${KILLS:-15} --out "$OUT/determinism.json" \
    > "$OUT/determinism.txt" 2> "$OUT/determinism.log"
  echo "rc $?" >> "$OUT/determinism.txt"
  tail -5 "$OUT/determinism.log"; cat "$OUT/determinism.txt"
}
ab() {
  config det 8000 true 17179869184
  config default 8100 false 17179869184
  serve_pair det default
  curl -s http://127.0.0.1:8000/v1/models > "$OUT/models_det.json"; curl -s http://127.0.0.1:8100/v1/models > "$OUT/models_default.json"
  POINTS=${POINTS:-chat:32 nano:256 chat:1} RUNS=${RUNS:-2} DURATION=${DURATION:-10} load_in_turn default det \
    | tee "$OUT/ab.txt"
  kill -TERM $pid_det $pid_default; wait $pid_det $pid_default
  python3 - "$OUT/ab_rows.txt" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if len(line.split()) >= 11]
print("workload       clients  out tok/s det/default   ITL p50 ms det/default (ITL: default/det, >= 0.85 wanted at 1)")
for w in dict.fromkeys((x[1], x[3]) for x in rows):
    med = lambda node, col: statistics.median(float(x[col].rstrip("*")) for x in rows if x[0] == node and (x[1], x[3]) == w)
    tok, itl = med("det", 6) / med("default", 6), med("default", 10) / med("det", 10)
    print(f"{w[0]:14} {w[1]:>7}  {med('det', 6):9.1f} / {med('default', 6):9.1f} = {tok:.3f}   "
          f"{med('det', 10):.2f} / {med('default', 10):.2f} (default/det {itl:.3f})")
PY
}
summary() {  # the short table: the probe's verdicts, the bench's counts
  echo "== summary"
  python3 - "$OUT/probe.json" "$OUT/determinism.json" <<'PY'
import json, sys
try:
    for r in json.load(open(sys.argv[1])):
        print(f"{r['case']:34} {r['mode']:13} identical {'yes' if r['identical'] else 'NO'}  max|diff| {r['max_diff']:.3g}")
except OSError:
    print("no probe.json")
try:
    res = json.load(open(sys.argv[2]))
    for name, p in res["phases"].items():
        kinds = ", ".join(f"{k} {c['identical']} of {c['replies']}" for k, c in sorted(p["by_kind"].items()))
        print(f"bench determinism {name}: {p['identical']} of {p['replies']} identical ({kinds}); {p['kills']} kills; "
              f"{p['failed']} failed")
except OSError:
    print("no determinism.json")
PY
}
case "${1:-}" in
tune) timeout ${TUNE_TIMEOUT:-560} python3 bench/probes/invariant_tune.py $M ${TUNE_ARGS:-} --json "$OUT/tune.json" > "$OUT/tune.txt" 2>&1
  echo "rc $?"; grep -B2 -A16 "^== kernels" "$OUT/tune.txt"; sed -n '/^== summary/,$p' "$OUT/tune.txt" ;;
check) check; summary ;;
ab) ab ;;
all) check > "$OUT/check.txt" 2>&1; ab; summary ;;
*) echo "usage: $0 check|ab|tune|all" >&2; exit 2 ;;
esac
