# Sourced by bench/gpu_*.sh on the GPU machine (device tool): the packages its image lacks (wheels
# carried in .whl/, see README), the environment every run needs, $OUT for logs, the 1b model in $M.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M:-/tmp/m1b}  # (a bench of another model: M=DIR, made before)
[ -f $M/config.json ] || python3 -m supervisor.cli make-model $M --preset 1b > "$OUT/make_model.log"

wait_ready() {  # wait_ready URL [TRIES]: until URL/readyz answers 200 (0.5 s apart)
  for _ in $(seq "${2:-240}"); do curl -sf "$1/readyz" >/dev/null && return 0; sleep 0.5; done
  echo "not ready: $1" >&2; return 1
}

all_ready() {  # all_ready CONFIG [TRIES]: until every engine and daemon of the supervisor is READY
  for _ in $(seq "${2:-240}"); do
    python3 -m supervisor.cli status -c "$1" --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin)
sys.exit(0 if all(x['state'] == 'READY' for x in d['engines'] + d['daemons']) else 1)" && return 0
    sleep 0.5
  done
  echo "not all READY: $1" >&2; return 1
}

since() { python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$1"; }  # seconds since an epoch time

memory() {  # memory CONFIG: GPU memory per device and per process, and the supervisor's view
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv
  python3 -m supervisor.cli status -c "$1"
}

start_serve() {  # start_serve CONFIG LOG: `understudy serve` in the background ($sup) until all is READY
  python3 -m supervisor.cli serve -c "$1" > "$2" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000 && all_ready "$1" || { tail -40 "$2"; kill -9 $sup; exit 1; }
}

serve_pair() {  # serve_pair A B: `understudy serve` of /tmp/A.yaml (router 8000) and /tmp/B.yaml (8100) at once,
  # in the background ($pid_A, $pid_B) until both are READY
  for n in "$1" "$2"; do python3 -m supervisor.cli serve -c /tmp/$n.yaml > "$OUT/serve_$n.log" 2>&1 & eval "pid_$n=$!"; done
  for n in "$1" "$2"; do
    wait_ready "http://127.0.0.1:$([ $n = "$1" ] && echo 8000 || echo 8100)" && all_ready /tmp/$n.yaml \
      || { tail -30 "$OUT/serve_$n.log"; eval "kill -9 \$pid_$1 \$pid_$2"; exit 1; }
  done
}

load_in_turn() {  # load_in_turn A B [C ...]: bench serve on /tmp/A.yaml, /tmp/B.yaml ... in turn, the order
  # rotated by one each run (two nodes: ABBA), for each workload:clients of $POINTS, $RUNS times after a run 0
  # of each (the prefix cache filled, the kernels loaded: left out of the medians); NUM_REQUESTS sets a run's
  # requests (bench serve's default, 8 x clients, is ~2 s of chat:32 on a GPU), DURATION caps its seconds;
  # rows in $OUT/ab_rows.txt, then the medians per workload and node, and the median of the runs' ratios to
  # the first node's out tok/s (each run's nodes are loaded back to back)
  local B="python3 -m supervisor.cli bench serve --client-procs 8 --no-static --duration ${DURATION:-15}"
  B="$B ${NUM_REQUESTS:+--num-requests $NUM_REQUESTS}"
  local nodes=("$@")
  : > "$OUT/ab_rows.txt"
  for point in $POINTS; do
    local w=${point%:*} c=${point#*:}
    for i in $(seq 0 "$RUNS"); do
      local order="${nodes[*]:$((i % $#))} ${nodes[*]:0:$((i % $#))}"
      for n in $order; do
        row=$(timeout 150 $B --workload $w -c /tmp/$n.yaml --concurrency $c 2>>"$OUT/bench.err" | grep -E "^ +$c ")
        echo "$n $w $i $row" | tee -a "$OUT/ab_rows.txt"
      done
    done
  done
  python3 - "$OUT/ab_rows.txt" "$@" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if len(line.split()) >= 11 and line.split()[2] != "0"]
nodes = sys.argv[2:]
print("workload       clients node    runs  TTFT p50 ms  TTFT p99 ms  out tok/s  ITL p50 ms  run ratio to "
      f"{nodes[0]}   (medians of bench serve's rows; run 0 left out)")
for w, c in dict.fromkeys((x[1], x[3]) for x in rows):  # (a workload at each client count)
    at = {(x[0], x[2]): x for x in rows if x[1] == w and x[3] == c}
    for node in nodes:
        r = [x for (n, _), x in at.items() if n == node]
        if not r:
            print(f"{w:14} {c:>7} {node:7}    0  (no run gave a row: bench.err)")
            continue
        med = lambda col: statistics.median(float(x[col].rstrip("*")) for x in r)
        ratios = [float(x[6]) / float(at[(nodes[0], run)][6]) for (n, run), x in at.items()
                  if n == node and (nodes[0], run) in at]
        ratio = f"{statistics.median(ratios):12.3f}" if ratios else f"{'-':>12}"
        print(f"{w:14} {c:>7} {node:7} {len(r):4}  {med(8):10.2f}  {med(9):11.2f}  {med(6):9.1f}  {med(10):10.2f}  "
              f"{ratio}")
PY
}
