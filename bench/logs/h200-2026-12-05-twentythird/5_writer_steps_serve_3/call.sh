#!/usr/bin/env bash
# the writer's per-step host work: HEAD (.ab/head) against this tree; GPU test of the event path; serving A/B
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && export SHARED_BYTES=17179869184 OWN_BYTES=8589934592
timeout 150 python3 -m pytest -q tests/test_shared_kv_engine.py -k cuda > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
echo "t=$SECONDS"
for b in 32 256; do for t in head this; do
  dir=$([ $t = head ] && echo .ab/head || echo .)
  echo "== $t batch $b"
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/probes/writer_steps.py $M --pool-gib 16 --batch $b --context 300 \
     --steps $([ $b = 32 ] && echo 400 || echo 200) --rounds 2 --variants own,writer,writer-notails 2>&1 | tail -15)
done; done > $OUT/writer_steps.txt 2>&1
echo "t=$SECONDS"
left=$((560 - SECONDS))
[ $left -gt 150 ] && BASE=$PWD/.ab/head OUT=$OUT/ab POINTS=chat:32 RUNS=6 timeout $((left - 10)) bash bench/gpu_shared_kv.sh ab > $OUT/ab.txt 2>&1
[ -d $OUT/ab ] && tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
echo "t=$SECONDS"
grep -E "^==|wall|tails|launched|publish_completed|GPU wait|read back" $OUT/writer_steps.txt
grep -A4 "^workload" $OUT/ab.txt; grep -E "^ +32 " $OUT/ab.txt
