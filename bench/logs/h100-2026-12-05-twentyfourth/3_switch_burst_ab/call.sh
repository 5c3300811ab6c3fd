#!/usr/bin/env bash
# twenty-fourth session, call 3: failover A/B, 253d9c0 (base) against this tree (the GIL in 0.1 ms slices for 1 s
# after a promotion), ABAB, 15 SIGKILLs a side-run, shared KV only
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
PROBES=0 TREES="base=.ab/253d9c0 burst=. base2=.ab/253d9c0 burst2=." RUNS=15 FAILOVER_TIMEOUT=150 timeout 570 bash bench/gpu_shared_kv.sh tree_ab > $OUT/printed.txt 2>&1
echo "t=$SECONDS"
grep -E "^==|gap across|continuations,|schedule of" $OUT/printed.txt | cut -c1-700
