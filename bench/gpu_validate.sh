#!/usr/bin/env bash
# Everything that must run on an H200, in one call per part (device tool). Usage:
#   bash bench/gpu_validate.sh weights   # daemon cuda transport + gpu tests + engine graphs, decode, restart
#   bash bench/gpu_validate.sh serve     # failover bench, memory figures, chaos run
#   bash bench/gpu_validate.sh kernels   # fused decode kernels: gpu engine tests, engine validate
# Expects the wheels of the packages the GPU image lacks in .whl/ (see README), writes logs to $OUT.
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi_start.csv"
case "${1:-weights}" in
weights)
  timeout 120 python3 -m pytest -q -m gpu tests/daemon/test_daemon_gpu.py tests/engines/process/test_engine_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout 220 python3 -m harness.gpu_check --model $M --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | tail -30
  timeout 190 python3 -m harness.bench.engine validate --device cuda --runs 3 --model-dir $M 2>&1 | tee "$OUT/engine_validate.log" | tail -30
  ;;
kernels)
  timeout 200 python3 -m pytest -q tests/engines/process/test_engine_gpu.py tests/models/test_kernels.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout 300 python3 -m harness.bench.engine validate --device cuda --runs 3 --model-dir $M 2>&1 | tee "$OUT/engine_validate.log" | tail -32
  for i in 2 3; do  # two more batch-1 decode runs: the median of three goes to RESULTS.md
    timeout 120 python3 -m harness.bench.engine decode $M --device cuda --batches 1 --json 2>&1 | tee "$OUT/decode_$i.log" | tail -3
  done
  ;;
serve)
  # 1. kill -> first success on the new primary, 20 SIGKILLs under load, and router overhead
  timeout 200 python3 -m supervisor.cli bench failover -c configs/h200-1b.yaml --model $M --runs 20 --overhead-requests 300 --json \
    > "$OUT/failover.json" 2> "$OUT/failover.log"; tail -22 "$OUT/failover.log"
  # 2. one supervisor for memory figures and a chaos run (short flap window: chaos kills on purpose)
  cat > /tmp/chaos.yaml <<YAML
device: cuda
gpu_ids: [0]
model: {path: $M, dtype: bfloat16}
engines: {count: 2, kv_cache_bytes: 4294967296, max_num_seqs: 32, max_model_len: 2048}
failover: {flap_window_s: 10, startup_timeout_s: 300}
YAML
  python3 -m supervisor.cli serve -c /tmp/chaos.yaml > "$OUT/serve.log" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000
  sleep 5
  { echo "# nvidia-smi with daemon + primary + standby READY"; nvidia-smi --query-gpu=memory.used,memory.total --format=csv;
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv;
    echo "# understudy status --json"; python3 -m supervisor.cli status --json -c /tmp/chaos.yaml; } > "$OUT/memory.txt" 2>&1
  head -8 "$OUT/memory.txt"
  timeout "${CHAOS_S:-330}" python3 -m supervisor.cli chaos -c /tmp/chaos.yaml --faults "${FAULTS:-kill-primary:50,kill-daemon:8}" \
    --interval 1.5 --warmup 5 --rate 20 --concurrency 32 --duration "$(( ${CHAOS_S:-330} - 20 ))" --settle 10 \
    --ready-timeout 120 --slo-failover-p99 0.15 --slo-recovery-p99 3 --out "$OUT/chaos" 2>&1 | tail -40
  rm -f "$OUT/chaos/raw.jsonl"
  kill -TERM $sup; wait $sup; echo "serve exit code $?"
  ;;
esac
