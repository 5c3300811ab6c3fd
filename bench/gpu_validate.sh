#!/usr/bin/env bash
# Everything that must run on an H200, in one call per part (device tool). Usage:
#   bash bench/gpu_validate.sh weights   # daemon cuda transport + gpu tests + engine graphs, decode, restart
#   bash bench/gpu_validate.sh serve     # failover bench, memory figures, chaos run
# Expects the wheels of the packages the GPU image lacks in .whl/ (see README), writes logs to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/m1b
t0=$(date +%s)
python3 -m engines.make_model $M --preset 1b | tee "$OUT/make_model.log"
echo "make-model 1b: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi_start.csv"
case "${1:-weights}" in
weights)
  timeout 120 python3 -m pytest -q -m gpu tests/test_daemon_gpu.py tests/test_engine_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout 220 python3 -m daemon.gpu_check --model $M --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | tail -30
  timeout 190 python3 -m engines.bench validate --device cuda --runs 3 --model-dir $M 2>&1 | tee "$OUT/engine_validate.log" | tail -30
  ;;
serve)
  timeout 300 python3 -m supervisor.cli bench failover --model $M --device cuda --runs 20 --json 2>&1 | tee "$OUT/failover.log" | tail -30
  ;;
esac
