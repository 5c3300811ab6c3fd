#!/usr/bin/env bash
# The shared KV pool on one H200 (device tool), the 1b preset in bf16, one call per part:
#   bash bench/gpu_shared_kv.sh ab        # two nodes at once on GPU 0: shared_kv (one 32 GiB pool) on
#                                         # 8000/8001 and shared_kv: false (16 GiB per engine: the same
#                                         # memory) on 8100/8101; GPU memory per process; bench serve
#                                         # chat:32 and nano:256 on each in turn (ABBA), medians last;
#                                         # then chat:32 once more on the shared node with the static decode
#                                         # (BASE=DIR: a third node, shared_kv on DIR's code, in the turns)
#   bash bench/gpu_shared_kv.sh failover  # understudy bench failover --streams 256 --runs 20 --compare:
#                                         # the gap of every stream in flight at each SIGKILL of the
#                                         # primary, failover_seconds, recomputed tokens, standby back;
#                                         # shared_kv: false beside it (STREAMS, RUNS change the counts;
#                                         # COMPARE= runs shared_kv only; RESTART_DELAY=S sets
#                                         # failover.restart_delay_s; KV_TAILS=true engines.kv_tails;
#                                         # PREFILL_CAP=N engines.max_prefill_tokens_per_step (default: none)
#                                         # on CUDA); each node's logs in $OUT/streams
#   bash bench/gpu_shared_kv.sh delays    # failover (shared KV only) once per restart delay of $DELAYS
#                                         # (default "0 1.5"), with the new primaries' first second
#   bash bench/gpu_shared_kv.sh gc_ab     # the collector frozen at startup or not (UNDERSTUDY_GC_FREEZE=0):
#                                         # bench serve on two nodes in turn, then failover on each
#   bash bench/gpu_shared_kv.sh batch_ab  # failover with router.migration.batch false, then true (BATCH=
#                                         # sets it for the other parts)
#   BASE=DIR bash bench/gpu_shared_kv.sh tree_ab  # failover on an older tree (DIR) and on this one, in turn
#                                         # (TREES="name=DIR ..." for other sides)
#   bash bench/gpu_shared_kv.sh warm_ab   # first_kernel.py, then failover (shared KV only) without and with the
#                                         # first-use warm-up (UNDERSTUDY_WARM_FIRST_USE: WARMS= names the sides'
#                                         # values, "-" for none; default "- gather sampling,graphs,gather")
#   bash bench/gpu_shared_kv.sh all       # ab, then failover
# Logs go to $OUT; the last lines printed are the figures.
source bench/gpu_env.sh
ROOT=$PWD  # (tree_ab runs the sides' trees from their folders; this tree's probes stay here)
config() {  # config NAME PORT SHARED KV_BYTES: the h200 config on $M, its own ports, dirs and KV mode
  sed "s#preset: 1b#path: $M#; s#port: 8000#port: $2#; s#port: 8001#port: $(($2 + 1))#" configs/h200-1b.yaml \
    | sed "s#kv_cache_bytes: .*#kv_cache_bytes: $4\n  shared_kv: $3#" \
    | sed "s#startup_timeout_s: 600#startup_timeout_s: 600\n  restart_delay_s: ${RESTART_DELAY:-0}#" \
    | sed "s#^  max_num_seqs: 256#  max_num_seqs: 256\n  kv_tails: ${KV_TAILS:-false}${PREFILL_CAP:+\n  max_prefill_tokens_per_step: $PREFILL_CAP}#" \
    | sed "s#^router:#router:\n  migration:\n    batch: ${BATCH:-true}#" > /tmp/$1.yaml
  printf 'runtime_dir: /tmp/rt-%s\ncache_dir: /tmp/cache-%s\n' "$1" "$1" >> /tmp/$1.yaml
}
ab() {  # (SHARED_BYTES, OWN_BYTES: the pools' sizes; an 80 GB H100 fits two nodes with 16 and 8 GiB.
  # BASE=DIR: a third node, shared_kv on DIR's code (ports 8200/8201), loaded in turn with the others)
  config shared 8000 true ${SHARED_BYTES:-34359738368}
  config own 8100 false ${OWN_BYTES:-17179869184}
  serve_pair shared own
  local nodes="own shared" n
  if [ -n "${BASE:-}" ]; then
    config base 8200 true ${SHARED_BYTES:-34359738368}
    (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE exec python3 -m supervisor.cli serve -c /tmp/base.yaml) \
      > "$OUT/serve_base.log" 2>&1 & pid_base=$!
    wait_ready http://127.0.0.1:8200 && all_ready /tmp/base.yaml \
      || { tail -30 "$OUT/serve_base.log"; kill -9 $pid_shared $pid_own $pid_base; exit 1; }
    nodes="own shared base"
  fi
  for n in $nodes; do echo "== $n"; python3 -m supervisor.cli status -c /tmp/$n.yaml; done > "$OUT/memory.txt" 2>&1
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/memory.txt"
  POINTS=${POINTS:-chat:32 nano:256} RUNS=${RUNS:-2} load_in_turn $nodes
  kill -TERM $pid_own ${BASE:+$pid_base}; wait $pid_own ${BASE:+$pid_base}
  # the static decode beside the live figures, in the same call: one more chat:32 run on the shared node
  timeout 300 python3 -m supervisor.cli bench serve --client-procs 8 --duration ${DURATION:-15} --workload chat \
    -c /tmp/shared.yaml --concurrency 32 > "$OUT/static_chat32.txt" 2>>"$OUT/bench.err"
  kill -TERM $pid_shared; wait $pid_shared
  tail -6 "$OUT/static_chat32.txt"
  cat "$OUT/memory.txt"
}
failover() {
  config streams 8000 true 34359738368
  timeout ${FAILOVER_TIMEOUT:-580} python3 -m supervisor.cli bench failover -c /tmp/streams.yaml --streams ${STREAMS:-256} \
    --runs ${RUNS:-20} ${KILL_FOR:+--kill-for $KILL_FOR} ${COMPARE---compare} --out $OUT/streams --json > "$OUT/failover_streams.json" \
    2> "$OUT/failover_streams.log"
  grep -v "^  kill" "$OUT/failover_streams.log" | tail -20
  python3 - "$OUT/failover_streams.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    g, q, f, rc = (r["gap_across_kill_ms"], r["gap_at_quiet_moments_ms"], r["failover_seconds_ms"],
                   r["recomputed_tokens_per_continuation"])
    a = r["gap_added_by_kill_ms"]
    print(f"shared_kv={r['shared_kv']}: gap across kill p50 {g.get('p50')} p99 {g.get('p99')} max {g.get('max')} ms "
          f"(n={g['n']}); at quiet moments p50 {q.get('p50')} p99 {q.get('p99')} max {q.get('max')} ms (n={q['n']}); "
          f"added by the kill p50 {a.get('p50')} p99 {a.get('p99')} ms (n={a.get('n')}); "
          f"failover_seconds p50 {f.get('p50')} max {f.get('max')} ms (n={f['n']}); recomputed max "
          f"{rc.get('max')} p50 {rc.get('p50')} (n={rc['n']}); standby back p50 {r['standby_back_s'].get('p50')} "
          f"max {r['standby_back_s'].get('max')} s; failed {r['failed']} of {r['requests']}; client CPU max "
          f"{r['client_cpu_share_max']}; promotion in the engine {r.get('promotion_in_engine_ms')}; kill to detection {r.get('kill_to_detection_ms')}; router CPU "
          f"{r['supervisor_cpu_share']}; its collections by generation {r['supervisor_gc']}")
    print("  the longest waits: " + ", ".join(f"{w['ms']} ms after {w['tokens_before']} token events, begun "
                                           f"+{w['after_kill_ms']} ms after a kill" for w in r.get("longest_waits", [])))
    for name, t in r["continuation_timeline_ms"].items():
        print(f"  continuations, {name} after the kill: p50 {t.get('p50')} p99 {t.get('p99')} max {t.get('max')} ms "
              f"(n={t.get('n')})")
    from harness.bench.failover_table import table  # (the bench's own table: quiet windows 5 s after READY)
    print(table(r))
PY
}
gc_pauses() {  # gc_pauses LOGS.tgz: the collections over 10 ms (the gc_pauses log lines) per process and generation
  python3 - "$1" <<'PY'
import collections, re, sys, tarfile
pauses = collections.defaultdict(list)
with tarfile.open(sys.argv[1]) as tar:
    for m in tar.getmembers():
        for line in tar.extractfile(m).read().decode(errors="replace").splitlines():
            if (g := re.search(r"generation (\d) paused (.+?)(?: \(pid \d+\))? for ([\d.]+) ms", line)):
                pauses[(g[2].replace("python3", "supervisor"), g[1])].append(float(g[3]))
print("GC pauses over 10 ms, per process (an engine's core engine-X, its front end engine-X-http) and generation:")
for (proc, gen), xs in sorted(pauses.items()):
    print(f"  {proc} gen {gen}: {len(xs)}, max {max(xs):.1f}, total {sum(xs):.0f} ms")
PY
}
failover_in() {  # failover_in DIR: failover with $OUT/DIR as its $OUT; the new primaries' first second
  # (the promotion trace) in DIR/promotion_trace.txt, its first lines printed; where each failover's
  # time went between the engines and the supervisor (bench/probes/failover_hops.py) in DIR/failover_hops.txt
  local base=$OUT
  OUT=$base/$1; mkdir -p "$OUT"
  failover
  tar xzf "$OUT/streams/logs-shared_kv-true.tgz" -O --wildcards '[ab]-*.log' | grep "after the promotion" \
    | sed 's/.*after the promotion: //' > "$OUT/promotion_trace.txt"
  cut -c1-700 "$OUT/promotion_trace.txt" | head -2
  python3 "$ROOT/bench/probes/failover_hops.py" "$OUT/streams/logs-shared_kv-true.tgz" > "$OUT/failover_hops.txt"
  head -1 "$OUT/failover_hops.txt"
  OUT=$base
}
delays() {  # failover (shared KV only) once per failover.restart_delay_s in $DELAYS, in one call: does the
  # replacement's start on the same GPU slow the new primary's first steps?
  local d
  for d in ${DELAYS:-0 1.5}; do
    echo "== failover.restart_delay_s: $d"
    RESTART_DELAY=$d COMPARE= failover_in delay_$d
    gc_pauses "$OUT/delay_$d/streams/logs-shared_kv-true.tgz" | tee "$OUT/delay_$d/gc_pauses.txt"
  done
}
batch_ab() {  # failover (shared KV only) with a failover's continuations one request each, then batched
  # (router.migration.batch false, true: BATCHES= names others), in one call
  local b
  for b in ${BATCHES:-false true}; do
    echo "== router.migration.batch: $b"
    BATCH=$b COMPARE= failover_in batch_$b
    rm -f "$OUT/batch_$b/failover_streams.log"  # (its lines are in the printed output; fewer files come back)
  done
}
warm_ab() {  # failover (shared KV only, RUNS kills) per UNDERSTUDY_WARM_FIRST_USE of $WARMS ("-": none), in
  # one call; each side's logs in one .tgz.
  # First, first_kernel.py: does a kernel's first call wait for the work on the GPU?
  python3 bench/probes/first_kernel.py | tee "$OUT/first_kernel.txt"
  local w
  for w in ${WARMS:-- gather sampling,graphs,gather}; do
    local side=warm_${w//,/_}
    echo "== UNDERSTUDY_WARM_FIRST_USE=${w#-}"
    UNDERSTUDY_WARM_FIRST_USE=${w#-} COMPARE= failover_in "$side"
    # what the warm-up took and left in torch's allocator (the standby's memory), per engine start
    tar xzf "$OUT/$side/streams/logs-shared_kv-true.tgz" -O --wildcards '[ab]-*.log' | grep "first_use: warmed" \
      | sed 's/.*warmed/warmed/' | head -3
    rm -f "$OUT/$side/failover_streams.log"
    tar czf "$OUT/$side.tgz" -C "$OUT" "$side" && rm -rf "${OUT:?}/$side"
  done
}
gc_ab() {  # the collector with the objects of startup frozen out (the default) against all in reach
  # (UNDERSTUDY_GC_FREEZE=0), in one call: two shared-KV nodes at once on GPU 0, bench serve on each in
  # turn (ABBA), then failover --streams on each in turn (RUNS kills; shared KV only)
  config frozen 8000 true 34359738368
  config unfrozen 8100 true 34359738368
  python3 -m supervisor.cli serve -c /tmp/frozen.yaml > "$OUT/serve_frozen.log" 2>&1 & pid_frozen=$!
  UNDERSTUDY_GC_FREEZE=0 python3 -m supervisor.cli serve -c /tmp/unfrozen.yaml > "$OUT/serve_unfrozen.log" 2>&1 &
  pid_unfrozen=$!
  for u in 8000 8100; do wait_ready http://127.0.0.1:$u || { kill -9 $pid_frozen $pid_unfrozen; exit 1; }; done
  all_ready /tmp/frozen.yaml && all_ready /tmp/unfrozen.yaml || { kill -9 $pid_frozen $pid_unfrozen; exit 1; }
  POINTS=${POINTS:-chat:32 nano:256} RUNS=${SERVE_RUNS:-2} load_in_turn unfrozen frozen > "$OUT/serve_ab.txt"
  kill -TERM $pid_frozen $pid_unfrozen; wait $pid_frozen $pid_unfrozen
  local mode
  for mode in unfrozen frozen; do
    echo "== failover, collector $mode"
    if [ $mode = unfrozen ]; then UNDERSTUDY_GC_FREEZE=0 COMPARE= failover_in failover_$mode
    else COMPARE= failover_in failover_$mode; fi
    gc_pauses "$OUT/failover_$mode/streams/logs-shared_kv-true.tgz" | tee "$OUT/failover_$mode/gc_pauses.txt"
  done
  tail -5 "$OUT/serve_ab.txt"
}
tree_ab() {  # failover (shared KV only, RUNS kills) on an older tree's files in $BASE (git archive of a commit,
  # untracked in this checkout so that it travels), then on this tree, in one call: the before/after of
  # the code between them; each side's files in one .tgz ($side/promotion_trace.txt, its failover JSON,
  # the nodes' logs) and its first admission steps' schedule printed (bench/probes/first_admission_steps.py);
  # then promote_cost.py (the claim and admissions on this host's CPU) on each.
  # TREES="name=DIR ..." names the sides and their trees instead (default "base=$BASE this=."); PROBES=0: no probes
  local side dir entry
  for entry in ${TREES:-base=$BASE this=.}; do
    side=${entry%%=*}; dir=${entry#*=}
    echo "== $side ($dir)"
    (cd "$dir" && PYTHONPATH=/tmp/site:$PWD COMPARE= OUT=$OUT failover_in $side)
    python3 "$ROOT/bench/probes/first_admission_steps.py" "$OUT/$side/promotion_trace.txt"
    rm -f "$OUT/$side/failover_streams.log"  # (its lines are in the printed output)
    tar czf "$OUT/$side.tgz" -C "$OUT" "$side" && rm -rf "${OUT:?}/$side"
  done
  [ "${PROBES:-1}" = 1 ] || return 0  # (PROBES=0: the failover runs only)
  for entry in ${TREES:-base=$BASE this=.}; do
    side=${entry%%=*}; dir=${entry#*=}
    echo "== promote_cost, $side: $( (cd "$dir" && PYTHONPATH=/tmp/site:$PWD python3 bench/probes/promote_cost.py --runs 7) 2>&1 | tail -1)"
  done
}
case "${1:-}" in
tree_ab) tree_ab ;;
warm_ab) warm_ab ;;
ab) ab ;;
gc_ab) gc_ab ;;
batch_ab) batch_ab ;;
failover) failover ;;
delays) delays ;;
all) ab > "$OUT/ab.txt" 2>&1; failover; tail -8 "$OUT/ab.txt" ;;
*) echo "usage: $0 ab|failover|delays|gc_ab|batch_ab|tree_ab|warm_ab|all" >&2; exit 2 ;;
esac
