#!/usr/bin/env bash
# twenty-sixth session, call 1: failover (shared KV only, 20 SIGKILLs a side) on 2fc8239 (the continuations
# after the promotion's round trip) and on this tree (sent ahead to the engine taking the pool over), in turn
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep "Model name" | tee -a $OUT/gpu.txt
PROBES=0 TREES="base=.ab/2fc8239 ahead=." RUNS=20 FAILOVER_TIMEOUT=255 bash bench/gpu_shared_kv.sh tree_ab > $OUT/tree_ab.txt 2>&1
echo "t=$SECONDS"
for side in base ahead; do
  mkdir -p /tmp/x/$side && tar xzf $OUT/$side.tgz -C /tmp/x
  tgz=$(ls /tmp/x/$side/streams/logs-*.tgz /tmp/x/$side/*/logs-*.tgz 2>/dev/null | head -1)
  mkdir -p /tmp/x/l-$side && tar xzf "$tgz" -C /tmp/x/l-$side
  grep -h "sent ahead were waiting\|fenced: \|not interrupted\|loop stalled\|stalled" /tmp/x/l-$side/*.log | sort > $OUT/lines_$side.txt
  echo "== $side: held at each promotion: $(grep -o '[0-9]* requests sent ahead' $OUT/lines_$side.txt | awk '{print $1}' | tr '\n' ' ')"
  echo "   fences: $(grep -o 'fenced: [0-9]* calls' $OUT/lines_$side.txt | awk '{print $2}' | tr '\n' ' ')"
  grep "not interrupted\|loop stalled" $OUT/lines_$side.txt | cut -c1-400 | head -5
  python3 bench/probes/failover_hops.py "$tgz" | head -1
done
grep "gap across" $OUT/tree_ab.txt | grep -v "^  kill" | cut -c1-450
