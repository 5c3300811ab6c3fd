#!/usr/bin/env bash
# twenty-third session, one device call: GPU tests, tree_ab e5ef347 vs this tree, serving A/B chat:32
cd "$(dirname "$0")/.." 
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && export SHARED_BYTES=17179869184 OWN_BYTES=8589934592
timeout 120 python3 -m pytest -q tests/test_engine_gpu.py tests/test_shared_kv_engine.py -k "cuda or copies" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
echo "t=$SECONDS"
PROBES=0 TREES="base=.ab/e5ef347 fix=." RUNS=10 timeout 300 bash bench/gpu_shared_kv.sh tree_ab > $OUT/printed.txt 2>&1
echo "t=$SECONDS"
for s in base fix; do
  echo "$s: $(tar xzf $OUT/$s.tgz -O $s/promotion_trace.txt 2>/dev/null | grep -o 'device memory +[0-9]* MiB' | sort | uniq -c | tr '\n' ';')"
done | tee $OUT/growth.txt
left=$((560 - SECONDS))
[ $left -gt 200 ] && OUT=$OUT/ab POINTS=chat:32 RUNS=4 DURATION=15 timeout $((left - 10)) bash bench/gpu_shared_kv.sh ab > $OUT/ab.txt 2>&1
[ -d $OUT/ab ] && tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
echo "t=$SECONDS"
grep -v "^  kill" $OUT/printed.txt | grep -E "^==|gap across|schedule of" | cut -c1-600
tail -12 $OUT/ab.txt
