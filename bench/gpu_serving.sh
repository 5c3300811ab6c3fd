#!/usr/bin/env bash
# The serving engine on an H200 (device tool), one call per part. Usage:
#   bash bench/gpu_serving.sh engine   # kernels natively, graphs == eager, static decode, offline nano
#   bash bench/gpu_serving.sh serve    # a real `understudy serve` under `understudy bench serve`
#   bash bench/gpu_serving.sh ttft     # shared-prefix time to first token: router vs engine, and the
#                                      # engine's own split (bench/probes/ttft_split.py)
#   bash bench/gpu_serving.sh profile  # py-spy of the router and the engine's front end under
#                                      # shared-prefix at 32 clients (py-spy wheel carried in .out/pyspy)
# Expects wheels of the packages the GPU image lacks in .whl/ (see README); logs go to $OUT.
source bench/gpu_env.sh
case "${1:-engine}" in
engine)
  timeout 200 python3 -m pytest -q tests/test_kernels.py tests/test_engine_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
  timeout 200 python3 -m engines.bench validate --device cuda --runs 1 --model-dir $M 2>&1 | tee "$OUT/engine_validate.log" | tail -20
  timeout 150 python3 -m engines.bench decode $M --device cuda --batches 1,8,32,64,128,256 --prompt-len 256 --tokens 128 --json \
    2>&1 | tee "$OUT/decode.log" | tail -12
  timeout 150 python3 bench/probes/offline_nano.py $M 2>&1 | tee "$OUT/offline_nano.log" | tail -4
  ;;
esac
case "${1:-engine}" in
probe)
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > /tmp/h200.yaml
  python3 -m supervisor.cli serve -c /tmp/h200.yaml > "$OUT/serve.log" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000
  if [ -z "${PROFILE:-}" ]; then
    timeout 200 python3 .out/live_probe.py http://127.0.0.1:8000 m1b chat 2>&1 | tee "$OUT/probe_chat.log"
    timeout 100 python3 .out/live_probe.py http://127.0.0.1:8000 m1b shared 2>&1 | tee "$OUT/probe_shared.log"
    primary=$(python3 -m supervisor.cli status -c /tmp/h200.yaml --json | python3 -c "import json,sys; print([e['url'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])")
    timeout 100 python3 .out/live_probe.py $primary m1b direct 2>&1 | tee "$OUT/probe_direct.log"
  fi
  python3 -m supervisor.cli status -c /tmp/h200.yaml > "$OUT/status.txt" 2>&1
  if [ -n "${PROFILE:-}" ]; then  # where the engine's and the router's CPU goes under 32 clients
    python3 -m pip install -q --no-index --no-deps --target /tmp/spy .out/pyspy/*.whl
    python3 .out/live_probe.py http://127.0.0.1:8000 m1b c32 > "$OUT/probe_c32.log" 2>&1 &
    sleep 5
    eng=$(python3 -m supervisor.cli status -c /tmp/h200.yaml --json | python3 -c "import json,sys; print([e['pid'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])")
    /tmp/spy/bin/py-spy record --pid $eng -d 6 -r 200 -f raw -o $OUT/engine_all.txt --threads --nonblocking &
    spy=$!
    /tmp/spy/bin/py-spy record --pid $sup -d 6 -r 200 -f raw -o $OUT/router.txt --nonblocking
    wait $spy
    /tmp/spy/bin/py-spy record --pid $eng -d 5 -r 200 -f raw -o $OUT/engine_gil.txt --gil --threads --nonblocking
    sleep 8; cat "$OUT/probe_c32.log"
  fi
  kill -TERM $sup; wait $sup
  ;;
esac
case "${1:-engine}" in
serve)  # the live path: a real `understudy serve` under `understudy bench serve`, static decode beside it
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > /tmp/h200.yaml
  python3 -m supervisor.cli serve -c /tmp/h200.yaml > "$OUT/serve.log" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000
  B="python3 -m supervisor.cli bench serve -c /tmp/h200.yaml --client-procs 8"
  timeout 200 $B --workload chat --concurrency 1,32,64,256 --out $OUT/chat 2>"$OUT/chat.err" | tee "$OUT/chat.txt"
  timeout 100 $B --workload shared-prefix --concurrency 32 --no-static --out $OUT/shared 2>"$OUT/shared.err" | tee "$OUT/shared.txt"
  timeout 100 $B --workload nano --no-static --out $OUT/nano 2>"$OUT/nano.err" | tee "$OUT/nano.txt"
  python3 -m supervisor.cli status -c /tmp/h200.yaml > "$OUT/status.txt" 2>&1
  kill -TERM $sup; wait $sup; echo "serve exit code $?"
  ;;
esac
case "${1:-engine}" in
ttft)
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > /tmp/h200.yaml
  python3 -m supervisor.cli serve -c /tmp/h200.yaml > "$OUT/serve.log" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000
  primary=$(python3 -m supervisor.cli status -c /tmp/h200.yaml --json | python3 -c "import json,sys; print([e['url'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])")
  B="python3 -m supervisor.cli bench serve -c /tmp/h200.yaml --client-procs 8 --workload shared-prefix --no-static --duration 15"
  for target in ${TTFT_RUNS:-router,1,a router,32,a engine,32,a}; do  # where,clients,run label
    set -- ${target//,/ }
    url=$([ $1 = engine ] && echo "--url $primary" || true)
    echo "== shared-prefix, $2 clients, through the $1 ($3)"
    timeout 100 python3 bench/probes/ttft_split.py $primary -- $B --concurrency $2 $url 2>>"$OUT/ttft.err" \
      | grep -v "^static decode" | tee "$OUT/ttft_$1_$2_$3.txt" | tail -6
  done
  kill -TERM $sup; wait $sup
  ;;
esac
case "${1:-engine}" in
profile)
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > /tmp/h200.yaml
  python3 -m supervisor.cli serve -c /tmp/h200.yaml > "$OUT/serve.log" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000 && all_ready /tmp/h200.yaml
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .out/pyspy/*.whl
  eng=$(python3 -m supervisor.cli status -c /tmp/h200.yaml --json | python3 -c "import json,sys; print([e['pid'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])")
  http=$(pgrep -P $eng http | head -1)
  python3 -m supervisor.cli bench serve -c /tmp/h200.yaml --client-procs 8 --workload shared-prefix --no-static \
    --concurrency 32 --num-requests 2048 > "$OUT/profile_bench.txt" 2>&1 &
  bench=$!; spies=""
  sleep 6
  for who in "router $sup" "frontend $http" "core $eng"; do
    set -- $who
    /tmp/spy/bin/py-spy record --pid $2 -d 6 -r 250 -f raw -o "$OUT/spy_$1.txt" --nonblocking --threads > /dev/null 2>&1 &
    spies="$spies $!"
  done
  wait $spies $bench; tail -3 "$OUT/profile_bench.txt"
  kill -TERM $sup; wait $sup
  ;;
esac
