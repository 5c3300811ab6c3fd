#!/usr/bin/env bash
# twenty-fifth session, call 1: the failover with the core's stall line (engines/seq_stalls.py): why does
# the core leave one sequence out for seconds on a new primary? 30 kills, shared KV only
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
FAILOVER_TIMEOUT=320 RUNS=30 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
echo "t=$SECONDS"
mkdir -p /tmp/l && tar xzf $OUT/streams/logs-shared_kv-true.tgz -C /tmp/l
grep -h "stalled\|not stepped\|preempt" /tmp/l/*.log > $OUT/stall_lines.txt; wc -l < $OUT/stall_lines.txt
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
grep -v "^  kill" $OUT/failover.txt | grep "gap across" | cut -c1-400
grep -c "not stepped" $OUT/stall_lines.txt
cut -c1-700 $OUT/stall_lines.txt | grep "not stepped" | head -12
cut -c1-300 $OUT/stall_lines.txt | grep -v "not stepped" | head -10
