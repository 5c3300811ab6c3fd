#!/usr/bin/env bash
# twenty-fourth session, call 2: the failover of record on the final tree (tails off, shared KV only), then the GPU tests
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
FAILOVER_TIMEOUT=470 RUNS=20 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
echo "t=$SECONDS"
left=$((585 - SECONDS))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q tests/test_engine_gpu.py tests/test_shared_kv_engine.py -k "cuda or copies" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
echo "t=$SECONDS"
tail -14 $OUT/failover.txt | cut -c1-900
