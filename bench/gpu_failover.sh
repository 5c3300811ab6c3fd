#!/usr/bin/env bash
# Failover on H200s (device tool), one call per part. Usage:
#   bash bench/gpu_failover.sh tp2       # TP=2 on GPUs 0,1 (nvidia-h200-x2): start, memory per GPU,
#                                        # failover under load (chaos), SIGTERM stop time (QUICK=1: no load)
#   bash bench/gpu_failover.sh restart   # supervisor SIGKILL + restart on the same sockets, 1b on GPU 0
#   bash bench/gpu_failover.sh streams   # 100 primary kills at 30 req/s, half streaming (continuation);
#                                        # KILLS=N and DTYPE=float32 change the count and the dtype
# Logs go to $OUT; the last lines printed are the figures.
source bench/gpu_env.sh
CHAOS="python3 -m supervisor.cli chaos --warmup 10 --concurrency 64 --ready-timeout 120 --settle 30"
case "${1:-}" in
tp2)
  C=/tmp/tp2.yaml
  cat > $C <<YAML
device: cuda
gpu_ids: [0, 1]
model: {path: $M, dtype: bfloat16, tp_size: 2}
engines: {count: 2, kv_cache_bytes: 8589934592, max_num_seqs: 256, max_model_len: 2048}
failover: {flap_window_s: 10, flap_max: 50, startup_timeout_s: 300}
YAML
  t0=$(date +%s.%N)
  start_serve $C "$OUT/tp2_serve.log"
  echo "tp2: start to all READY $(since $t0) s"
  memory $C > "$OUT/tp2_memory.txt" 2>&1; head -12 "$OUT/tp2_memory.txt"
  if [ -z "${QUICK:-}" ]; then  # QUICK=1: start, memory and stop only
    timeout 60 python3 -m supervisor.cli bench serve -c $C --client-procs 8 --workload chat --concurrency 32 --no-static \
      --out "$OUT/tp2_bench" 2>"$OUT/tp2_bench.err" | tail -4
    timeout 200 $CHAOS -c $C --faults kill-primary:20 --interval 3 --rate 20 --max-tokens 64 --duration 180 \
      --slo-failover-p99 0.15 --slo-recovery-p99 5 --out "$OUT/tp2_chaos" 2>&1 | tail -25
    gzip "$OUT/tp2_chaos/raw.jsonl"
  fi
  all_ready $C 60
  t1=$(date +%s.%N); kill -TERM $sup; wait $sup; rc=$?
  echo "tp2: SIGTERM -> supervisor exit $(since $t1) s, exit code $rc"
  for i in 1 2 3 4 5; do sleep 1; echo "left running after ${i} s: $(pgrep -fc 'python3 -m (engines|daemon|supervisor)' || true)"; done
  ps -eo pid,ppid,etimes,args | grep -E 'python3 -m (engines|daemon|supervisor)' | grep -v grep | cut -c1-160
  grep -E "drain|stopp|exit" "$OUT/tp2_serve.log" | tail -12
  ;;
restart)
  sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > /tmp/h200.yaml
  timeout 500 python3 -m supervisor.cli bench supervisor-restart -c /tmp/h200.yaml --runs ${RUNS:-20} --rate 20 --json \
    > "$OUT/supervisor_restart.json" 2> "$OUT/supervisor_restart.log"; tail -26 "$OUT/supervisor_restart.log"
  ;;
streams)
  C=/tmp/h200-chaos.yaml
  cat > $C <<YAML
device: cuda
gpu_ids: [0]
model: {path: $M, dtype: ${DTYPE:-bfloat16}}
engines: {count: 2, kv_cache_bytes: 17179869184, max_num_seqs: 256, max_model_len: 2048}
failover: {heartbeat_timeout_s: 5, startup_timeout_s: 600, flap_window_s: 10, flap_max: 50}
YAML
  start_serve $C "$OUT/streams_serve.log"
  timeout 560 $CHAOS -c $C --faults kill-primary:${KILLS:-100} --interval 2.5 --rate 30 --stream-fraction 0.5 --max-tokens 64 \
    --duration 520 --slo-failover-p99 0.15 --slo-recovery-p99 3 --out "$OUT/streams_chaos" 2>&1 | tail -40
  gzip "$OUT/streams_chaos/raw.jsonl"
  kill -TERM $sup; wait $sup; echo "serve exit code $?"
  ;;
*) echo "usage: $0 tp2|restart|streams" >&2; exit 2 ;;
esac
