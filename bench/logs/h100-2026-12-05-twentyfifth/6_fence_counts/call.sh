#!/usr/bin/env bash
# twenty-fifth session, call 6: failover (shared KV only, 18 kills): how many calls each fence interrupts
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
FAILOVER_TIMEOUT=170 RUNS=18 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
mkdir -p /tmp/l && tar xzf $OUT/streams/logs-shared_kv-true.tgz -C /tmp/l
grep -h "fenced: \|continuation_batch: batch\|loop stalled\|stalled" /tmp/l/*.log | sort > $OUT/fence_lines.txt
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
grep -v "^  kill" $OUT/failover.txt | grep "gap across" | cut -c1-420
grep -o "epoch [0-9]* fenced: [0-9]* calls" $OUT/fence_lines.txt | awk '{print $4}' | sort -n | uniq -c
grep -o "batch [0-9a-f]*: [0-9]* of [0-9]*" $OUT/fence_lines.txt | awk '{print $3}' | sort -n | uniq -c
