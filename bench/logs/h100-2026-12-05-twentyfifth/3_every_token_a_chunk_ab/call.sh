#!/usr/bin/env bash
# twenty-fifth session, call 3: failover (shared KV only, 25 kills) on 6f83122 and on 5db1b8c (every token a chunk;
# the detokenizer streams stray bytes), in turn: the before/after of the stalls of text-less tokens
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
PROBES=0 TREES="before=.ab/instr after=." RUNS=25 FAILOVER_TIMEOUT=280 bash bench/gpu_shared_kv.sh tree_ab > $OUT/tree_ab.txt 2>&1
echo "t=$SECONDS"
for side in before after; do
  mkdir -p /tmp/x/$side && tar xzf $OUT/$side.tgz -C /tmp/x
  ls /tmp/x/$side > /dev/null
  tgz=$(ls /tmp/x/$side/streams/logs-*.tgz /tmp/x/$side/*/logs-*.tgz 2>/dev/null | head -1)
  mkdir -p /tmp/x/l-$side && tar xzf "$tgz" -C /tmp/x/l-$side
  grep -h "stalled\|not stepped" /tmp/x/l-$side/*.log > $OUT/stall_lines_$side.txt
  echo "== $side: $(wc -l < $OUT/stall_lines_$side.txt) stall lines"
  cut -c1-330 $OUT/stall_lines_$side.txt | head -12
done
grep "gap across" $OUT/tree_ab.txt | grep -v "^  kill" | cut -c1-450
