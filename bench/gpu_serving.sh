#!/usr/bin/env bash
# The serving engine on an H200 (device tool), one call per part. Usage:
#   bash bench/gpu_serving.sh engine   # kernels natively, graphs == eager, static decode
#   bash bench/gpu_serving.sh probe    # the chat sweep through the router, shared-prefix, and 256 clients on the
#                                      # primary engine directly (`understudy bench serve`, no static decode)
#   bash bench/gpu_serving.sh serve    # a real `understudy serve` under `understudy bench serve`
#   bash bench/gpu_serving.sh ttft     # shared-prefix time to first token: router vs engine, and the
#                                      # engine's own split (bench/probes/ttft_split.py); TTFT_RUNS
#                                      # lists where,clients,label triples
#   bash bench/gpu_serving.sh profile  # py-spy of the router, the engine's front end and its core under
#                                      # shared-prefix at 32 clients (py-spy wheel carried in .out/pyspy)
# Expects wheels of the packages the GPU image lacks in .whl/ (see README); logs go to $OUT.
source bench/gpu_env.sh
C=/tmp/h200.yaml

serve_1b() {  # configs/h200-1b.yaml on the model in $M, in the background ($sup), until ready
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > $C
  start_serve $C "$OUT/serve.log"
}

primary() {  # primary url|pid: the primary engine's field, from the supervisor's status
  python3 -m supervisor.cli status -c $C --json \
    | python3 -c "import json,sys; print([e['$1'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])"
}

stop_serve() {
  python3 -m supervisor.cli status -c $C > "$OUT/status.txt" 2>&1
  kill -TERM $sup; wait $sup; echo "serve exit code $?"
}

case "${1:-engine}" in
engine)
  timeout 200 python3 -m pytest -q tests/models/test_kernels.py tests/engines/process/test_engine_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
  timeout 200 python3 -m harness.bench.engine validate --device cuda --runs 1 --model-dir $M 2>&1 | tee "$OUT/engine_validate.log" | tail -20
  timeout 150 python3 -m harness.bench.engine decode $M --device cuda --batches 1,8,32,64,128,256 --prompt-len 256 --tokens 128 --json \
    2>&1 | tee "$OUT/decode.log" | tail -12
  ;;
probe)
  serve_1b
  B="python3 -m supervisor.cli bench serve -c $C --client-procs 8 --no-static"
  timeout 200 $B --workload chat --concurrency 1,32,64,256 2>&1 | tee "$OUT/probe_chat.log"
  timeout 100 $B --workload shared-prefix --concurrency 32 --num-requests 256 2>&1 | tee "$OUT/probe_shared.log"
  timeout 100 $B --url "$(primary url)" --workload chat --concurrency 256 --num-requests 1024 2>&1 \
    | tee "$OUT/probe_direct.log"
  stop_serve
  ;;
serve)  # the live path: a real `understudy serve` under `understudy bench serve`, static decode beside it
  serve_1b
  B="python3 -m supervisor.cli bench serve -c $C --client-procs 8"
  timeout 200 $B --workload chat --concurrency 1,32,64,256 --out $OUT/chat 2>"$OUT/chat.err" | tee "$OUT/chat.txt"
  timeout 100 $B --workload shared-prefix --concurrency 32 --no-static --out $OUT/shared 2>"$OUT/shared.err" | tee "$OUT/shared.txt"
  timeout 100 $B --workload nano --no-static --out $OUT/nano 2>"$OUT/nano.err" | tee "$OUT/nano.txt"
  stop_serve
  ;;
ttft)
  serve_1b
  url=$(primary url)
  B="python3 -m supervisor.cli bench serve -c $C --client-procs 8 --workload shared-prefix --no-static --duration 15"
  for target in ${TTFT_RUNS:-router,1,a router,32,a engine,32,a}; do  # where,clients,run label
    set -- ${target//,/ }
    echo "== shared-prefix, $2 clients, through the $1 ($3)"
    timeout 100 python3 bench/probes/ttft_split.py $url -c $C -- $B --concurrency $2 $([ $1 = engine ] && echo "--url $url") \
      2>>"$OUT/ttft.err" | grep -v "^static decode" | tee "$OUT/ttft_$1_$2_$3.txt" | tail -8
  done
  stop_serve
  ;;
profile)  # PROFILE lists workload:clients:requests triples (default shared-prefix:32:2048)
  serve_1b
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .out/pyspy/*.whl
  eng=$(primary pid)
  http=$(pgrep -P $eng http | head -1)  # the front end's process name is engine-<name>-http
  for point in ${PROFILE:-shared-prefix:32:2048}; do
    set -- ${point//:/ }; w=$1; n=$2; r=$3
    python3 -m supervisor.cli bench serve -c $C --client-procs 8 --workload $w --no-static \
      --concurrency $n --num-requests $r > "$OUT/profile_${w}_bench.txt" 2>&1 &
    bench=$!; spies=""
    sleep 6
    python3 bench/probes/cpu_share.py 6 router=$sup frontend=$http core=$eng > "$OUT/profile_${w}_cpu.txt" &
    spies="$!"
    for who in "router $sup" "frontend $http" "core $eng"; do
      set -- $who
      /tmp/spy/bin/py-spy record --pid $2 -d 6 -r 250 -f raw -o "$OUT/spy_${w}_$1.txt" --nonblocking --threads > /dev/null 2>&1 &
      spies="$spies $!"
    done
    wait $spies $bench; echo "== $w at $n clients"; cat "$OUT/profile_${w}_cpu.txt"; tail -3 "$OUT/profile_${w}_bench.txt"
  done
  tar -czf "$OUT/spy.tgz" -C "$OUT" $(cd "$OUT" && ls spy_*.txt) && rm "$OUT"/spy_*.txt
  stop_serve
  ;;
*) echo "usage: $0 engine|probe|serve|ttft|profile" >&2; exit 2 ;;
esac
