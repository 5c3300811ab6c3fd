#!/usr/bin/env bash
# FP8 and Mixture-of-Experts on a GPU (device tool), one call per part; logs go to $OUT. Usage:
#   bash bench/gpu_fp8_moe.sh tests  # every GPU-marked test file, and the FP8 products' speed (bench/probes/fp8_gemm.py)
#   bash bench/gpu_fp8_moe.sh min    # tests, the FP8 products' speed (a sweep of tiles), the 1b's nano in bf16 and FP8
#   bash bench/gpu_fp8_moe.sh fp8    # 8b in bf16 and FP8 block-wise: weights, offline nano, logits error, restart
#                                    # (FO8B=1: and the failover of record on the FP8 8b, 64 streams, 20 kills)
#   bash bench/gpu_fp8_moe.sh moe    # the FP8 products; moe-30b-a3b in FP8: restart, memory;
#                                    # the 1b's nano in bf16 and FP8
#   bash bench/gpu_fp8_moe.sh graphs # the FP8 and MoE tests of graphs against eager and of the numerics check,
#                                    # and whether an FP8 product's row bits depend on its tile; the MoE grouping's cost
#   bash bench/gpu_fp8_moe.sh nano8b # the 8b's nano in bf16 and FP8
#   MODEL=moe30|m1b bash bench/gpu_fp8_moe.sh fo  # the failover alone (RUNS kills, 3)
#   bash bench/gpu_fp8_moe.sh moea1b # moe-a1b in bf16 and FP8: nano; transformers' continuous batching (bf16) beside
#   bash bench/gpu_fp8_moe.sh profile # moe-30b-a3b's restart with its numerics and graph capture under cProfile
# Several modes in one call run in turn (`fo fp8`). Everything under $OUT comes back as one logs.tgz.
# Expects wheels of the packages the GPU image lacks in .whl/ (see README): fastapi, uvicorn, pyzmq, pydantic
# (+ pydantic-core, annotated-types, typing-inspection), httptools, orjson, starlette, anyio, sniffio, h11, click,
# annotated-doc, typing-extensions, pytest-timeout, and opentelemetry-api (fastapi 0.165 imports it), at the
# versions of constraints.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
U="python3 -m supervisor.cli"
made() { [ -f "$1/config.json" ] || $U make-model "$1" --device cuda "${@:2}" >> "$OUT/make_model.log" 2>&1; }
nano() {  # nano MODEL_DIR LABEL: bench serve's nano workload, offline (the engine in this process)
  timeout "${NANO_S:-240}" $U bench serve --offline "$1" --workload nano --device cuda 2>&1 | tee "$OUT/nano_$2.txt" | tail -4
}

failover_on() {  # failover_on MODEL LABEL: the failover of record (64 streams, 20 SIGKILLs), shared KV; no kill
  # starts after KILL_FOR s of kills (default: FAILOVER_S less 90: the boot, the last kill, the report), so
  # the streams' side is reported before FAILOVER_S
  M=$1 STREAMS=64 RUNS=${RUNS:-20} COMPARE= FAILOVER_TIMEOUT=${FAILOVER_S:-240} KILL_FOR=${KILL_FOR:-$((${FAILOVER_S:-240} - 90))} \
    OUT=$OUT/failover_$2 \
    bash bench/gpu_shared_kv.sh failover 2>&1 | tail -8
}

memory_on() {  # memory_on MODEL LABEL: GPU memory per process, the node READY (the parked standby's share)
  (M=$1; source bench/gpu_env.sh; sed "s#preset: 1b#path: $1#" configs/h200-1b.yaml > /tmp/mem.yaml
   start_serve /tmp/mem.yaml "$OUT/serve_memory_$2.log"; memory /tmp/mem.yaml > "$OUT/memory_$2.txt" 2>&1
   kill -TERM $sup; wait $sup)
  cat "$OUT/memory_$2.txt"
}

gpu_tests() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  timeout "${1:-420}" python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/models/test_fp8_moe_gpu.py tests/models/test_fp8.py tests/models/test_moe.py \
    tests/models/test_invariant_ops.py tests/models/test_kernels.py tests/daemon/test_daemon_gpu.py \
    tests/models/test_deterministic_model.py tests/engines/process/test_engine_gpu.py \
    tests/engines/kv/test_shared_kv_engine.py tests/supervisor/processes/test_supervisor_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
}

for mode in "${@:-tests}"; do
case "$mode" in
min)  # the CUDA paths only: every GPU-marked test file, the FP8 products' speed with a sweep of tiles,
  # and the 1b's nano in bf16 and FP8
  gpu_tests 220
  timeout 100 python3 bench/probes/fp8_gemm.py --sweep --budget 70 2>&1 | tee "$OUT/fp8_gemm.txt"
  made /tmp/m1b --preset 1b; made /tmp/m1b-fp8 --preset 1b --quant fp8-block
  for m in m1b m1b-fp8; do NANO_S=60 nano /tmp/$m $m; done
  ;;
tests)
  gpu_tests 420
  timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/models/test_fp8_moe_gpu.py -k numerics 2>&1 \
    | grep -E "^(fp8|moe)" | tee "$OUT/numerics_tiny.txt"
  timeout 120 python3 bench/probes/fp8_gemm.py 2>&1 | tee "$OUT/fp8_gemm.txt"
  ;;
fp8)
  made /tmp/m8b --preset 8b; made /tmp/m8b-fp8 --preset 8b --quant fp8-block
  du -sh /tmp/m8b /tmp/m8b-fp8 | tee "$OUT/sizes.txt"
  timeout 90 python3 bench/probes/fp8_error.py /tmp/m8b-fp8 2>&1 | tee "$OUT/fp8_error.txt" | tail -6
  for m in m8b m8b-fp8; do nano /tmp/$m $m; done
  timeout 150 $U bench restart /tmp/m8b-fp8 --runs 2 --device cuda 2>&1 | tee "$OUT/restart_8b_fp8.txt" | tail -5
  [ -n "${FO8B:-}" ] && failover_on /tmp/m8b-fp8 8b_fp8
  ;;
moe)  # most telling first: the FP8 products (ours and cuBLAS's block-scaled), moe-30b-a3b in FP8: restart
  # (with its engines' logs), memory; the 1b's nano in bf16 and FP8
  timeout 90 python3 bench/probes/fp8_gemm.py 2>&1 | tee "$OUT/fp8_gemm.txt"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -k cublas tests/models/test_fp8_moe_gpu.py \
    tests/models/test_fp8.py 2>&1 | tee "$OUT/gpu_tests_cublas.txt" | tail -3
  made /tmp/moe30 --preset moe-30b-a3b --quant fp8-block
  timeout 130 $U bench restart /tmp/moe30 --runs 2 --device cuda --work-dir /tmp/rs 2>&1 | tee "$OUT/restart_moe30.txt" | tail -4
  grep -h "numerics against\|allocator holds" /tmp/rs/*.log | cut -c1-400 > "$OUT/restart_engine_lines.txt"
  timeout 100 bash -c "$(declare -f memory_on); memory_on /tmp/moe30 moe30"
  grep -rh "allocator holds" ${XDG_RUNTIME_DIR:-/nonexistent}/understudy /tmp/understudy-$(id -u) 2>/dev/null | cut -c1-400 \
    >> "$OUT/memory_moe30.txt"
  made /tmp/m1b --preset 1b; made /tmp/m1b-fp8 --preset 1b --quant fp8-block
  for m in m1b m1b-fp8; do NANO_S=60 nano /tmp/$m $m; done
  ;;
fo)  # the failover alone (RUNS kills, 3) on $MODEL (moe30: moe-30b-a3b in FP8; m1b: the 1b in bf16)
  case "${MODEL:-moe30}" in moe30) made /tmp/moe30 --preset moe-30b-a3b --quant fp8-block;; m1b) made /tmp/m1b --preset 1b;; esac
  RUNS=${RUNS:-3} FAILOVER_S=${FAILOVER_S:-110} failover_on /tmp/${MODEL:-moe30} ${MODEL:-moe30}
  [ -n "${KEEP:-}" ] || rm -rf /tmp/moe30  # (the disk: 8b and its FP8 twin may come next; KEEP=1: profile next)
  ;;
graphs)  # the FP8 and MoE tests of CUDA graphs against eager, and of the numerics check; whether an FP8
  # product's row bits depend on its tile (per-tensor FP8's graph tokens: bench/probes/fp8_tile_bits.py)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k "graphs or numerics" tests/models/test_fp8_moe_gpu.py \
    2>&1 | tee "$OUT/gpu_tests_graphs.txt" | tail -4
  timeout 60 python3 bench/probes/fp8_tile_bits.py 2>&1 | tee "$OUT/fp8_tile_bits.txt"
  timeout 60 python3 bench/probes/moe_grouping.py 2>&1 | tee "$OUT/moe_grouping.txt"
  ;;
nano8b)  # the 8b's nano in bf16 and FP8 block-wise, one call
  made /tmp/m8b --preset 8b; made /tmp/m8b-fp8 --preset 8b --quant fp8-block
  for m in m8b m8b-fp8; do nano /tmp/$m $m; done
  ;;
profile)  # where moe-30b-a3b's restart spends its time: each phase under cProfile (one spawn restart,
  # UNDERSTUDY_PROFILE_DIR: also the GPU memory after each phase; PROFILE_NODE=1: then the node's), each
  # graph's capture time, Triton's version and kernel cache
  made /tmp/moe30 --preset moe-30b-a3b --quant fp8-block
  UNDERSTUDY_PROFILE_DIR=$OUT/profile timeout 150 $U bench restart /tmp/moe30 --runs 1 --device cuda --work-dir /tmp/rp \
    2>&1 | tee "$OUT/restart_profiled.txt" | tail -3
  grep -h "captured\|numerics against" /tmp/rp/*.log | cut -c1-1500 > "$OUT/restart_profiled_lines.txt"
  [ -z "${PROFILE_NODE:-}" ] || UNDERSTUDY_PROFILE_DIR=$OUT/profile_node timeout 100 \
    bash -c "$(declare -f memory_on); memory_on /tmp/moe30 moe30"
  python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" >> "$OUT/restart_profiled.txt"
  du -sh ~/.triton/cache 2>/dev/null >> "$OUT/restart_profiled.txt"; ls ~/.triton/cache 2>/dev/null | wc -l >> "$OUT/restart_profiled.txt"
  ;;
moea1b)
  made /tmp/moea1b --preset moe-a1b; made /tmp/moea1b-fp8 --preset moe-a1b --quant fp8-block
  for m in moea1b moea1b-fp8; do NANO_S=150 nano /tmp/$m $m; done
  timeout ${TF_S:-240} python3 bench/probes/transformers_cb.py /tmp/moea1b 2>&1 | tee "$OUT/transformers_cb_moea1b.txt" | tail -2
  ;;
esac
done
# (at most 8 files come back from $OUT: all of them in one archive)
tar czf /tmp/logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/logs.tgz "$OUT"/
