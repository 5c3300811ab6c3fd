#!/usr/bin/env bash
# A serving change against its base on one H200, interleaved in one device call: these machines
# differ by several ms of time to first token from one start to the next, so a change is only
# measured against a base that runs on the same machine in the same minutes.
#   rm -rf _base && mkdir _base && git archive BASE | tar -x -C _base
#   bash bench/gpu_ab.sh _base        # RUNS=3, POINTS="shared-prefix:32" by default (workload:clients ...)
# Both nodes serve at once on GPU 0 (configs/h200-1b.yaml, the 1b preset, bf16): this tree on ports
# 8000/8001, the base on 8100/8101, each with its own runtime dir. The same client (this tree's
# `understudy bench serve`, DURATION=15 s per run, no static decode) loads each in turn, base and this tree
# alternating in ABBA order. Prints each run's row, then the medians; $OUT/memory.txt has the GPU memory
# of every process of both nodes. STATIC=1: then one more run of the first point on this tree's node
# alone, beside bench serve's static decode.
source bench/gpu_env.sh
BASE=$(cd "${1:?usage: $0 BASE_DIR}" && pwd) || { echo "gpu_ab.sh: no base tree at $1" >&2; exit 1; }
ln -sfn "$PWD/.whl" "$BASE/.whl"
RUNS=${RUNS:-3}
node() {  # node NAME PORT DIR: a config for the node, then `understudy serve` from DIR's code
  sed "s#preset: 1b#path: $M#; s#port: 8000#port: $2#; s#port: 8001#port: $(($2 + 1))#" configs/h200-1b.yaml \
    > /tmp/$1.yaml
  printf 'runtime_dir: /tmp/rt-%s\ncache_dir: /tmp/cache-%s\n' "$1" "$1" >> /tmp/$1.yaml
  (cd "$3" && PYTHONPATH=/tmp/site:$3 exec python3 -m supervisor.cli serve -c /tmp/$1.yaml) > "$OUT/serve_$1.log" 2>&1 &
  eval "pid_$1=$!"
}
node new 8000 "$PWD"
node base 8100 "$BASE"
for n in new base; do
  wait_ready "http://127.0.0.1:$([ $n = new ] && echo 8000 || echo 8100)" && all_ready /tmp/$n.yaml \
    || { tail -30 "$OUT/serve_$n.log"; kill -9 $pid_new $pid_base; exit 1; }
done
POINTS=${POINTS:-shared-prefix:32} load_in_turn base new
for n in new base; do  # GPU memory per process, and each node's pids (same kv_cache_bytes in both)
  echo "== $n"; python3 -m supervisor.cli status -c /tmp/$n.yaml
done > "$OUT/memory.txt" 2>&1
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/memory.txt"
if [ -n "${STATIC:-}" ]; then  # the static decode beside the live figures, in the same call: the base node
  # stopped, one more run of the first point on this tree's node, with bench serve's static decode
  kill -TERM $pid_base; wait $pid_base
  p=${POINTS%% *}
  timeout 300 python3 -m supervisor.cli bench serve --client-procs 8 --duration ${DURATION:-15} --workload ${p%:*} \
    -c /tmp/new.yaml --concurrency ${p#*:} > "$OUT/static.txt" 2>>"$OUT/bench.err"
  tail -6 "$OUT/static.txt"
  kill -TERM $pid_new; wait $pid_new
  exit 0
fi
kill -TERM $pid_new $pid_base; wait $pid_new $pid_base
