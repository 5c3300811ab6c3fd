#!/usr/bin/env bash
# twenty-fourth session, call 4: the failover with the stall logs (engines/stalls.py): where do the 1-2 s
# single-stream stalls wait? 20 kills, shared KV only
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
FAILOVER_TIMEOUT=200 RUNS=20 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
echo "t=$SECONDS"
mkdir -p /tmp/l && tar xzf $OUT/streams/logs-shared_kv-true.tgz -C /tmp/l
grep -h "stalled" /tmp/l/*.log > $OUT/stall_lines.txt; wc -l < $OUT/stall_lines.txt
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
grep -o "longest waits.*" $OUT/failover.txt | cut -c1-600
grep -v "^  kill" $OUT/failover.txt | grep "gap across" | cut -c1-400
cut -c1-330 $OUT/stall_lines.txt | head -30
