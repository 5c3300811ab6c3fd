#!/usr/bin/env bash
# twenty-fifth session, call 5: failover (shared KV only, 35 kills) with each kill's detection timed
# (from the kill to the supervisor's detection): are the rare late losses late detections?
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
FAILOVER_TIMEOUT=330 RUNS=35 COMPARE= bash bench/gpu_shared_kv.sh failover > $OUT/failover.txt 2>&1
echo "t=$SECONDS"
mkdir -p /tmp/l && tar xzf $OUT/streams/logs-shared_kv-true.tgz -C /tmp/l
grep -h "stalled\|not stepped" /tmp/l/*.log > $OUT/stall_lines.txt
python3 bench/probes/failover_hops.py $OUT/streams/logs-shared_kv-true.tgz > $OUT/failover_hops.txt
tar czf $OUT/streams.tgz -C $OUT streams && rm -rf $OUT/streams
grep -v "^  kill" $OUT/failover.txt | grep "gap across" | cut -c1-420
head -1 $OUT/failover_hops.txt
echo "$(wc -l < $OUT/stall_lines.txt) stall lines; slowest failovers:"
grep -ho "epoch [0-9]*, exit, [0-9.]* ms" /tmp/l/supervisor.log | sort -t, -k3 -g | tail -4
cut -c1-900 $OUT/stall_lines.txt | head -8
grep "^  kill" $OUT/failover_streams.log | awk "{print \$4, \$0}" | sort -g | tail -5 | cut -c1-200
