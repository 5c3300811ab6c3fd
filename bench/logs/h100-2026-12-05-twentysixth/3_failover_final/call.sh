#!/usr/bin/env bash
# twenty-sixth session, call 3: the final tree: failover (shared KV only, 25 SIGKILLs), then the GPU tests
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep "Model name" | tee -a $OUT/gpu.txt
FAILOVER_TIMEOUT=300 RUNS=25 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
echo "t=$SECONDS"
mkdir -p /tmp/l && tar xzf $OUT/streams/logs-shared_kv-true.tgz -C /tmp/l
grep -h "fenced: \|not interrupted\|loop stalled\|stalled" /tmp/l/*.log | sort > $OUT/fence_lines.txt
python3 bench/probes/failover_hops.py $OUT/streams/logs-shared_kv-true.tgz > $OUT/failover_hops.txt 2>&1
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
grep -v "^  kill" $OUT/failover.txt | grep "gap across\|after the kill" | cut -c1-450
echo "fences (calls interrupted: how many kills):"; grep -o "epoch [0-9]* fenced: [0-9]* calls" $OUT/fence_lines.txt | awk '{print $4}' | sort -n | uniq -c
grep "not interrupted\|loop stalled" $OUT/fence_lines.txt | cut -c1-400 | head -5
head -1 $OUT/failover_hops.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_shared_kv_engine.py -k "cuda or copies or gpu" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
echo "t=$SECONDS"
