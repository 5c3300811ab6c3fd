#!/usr/bin/env bash
# twenty-fourth session, call 1: serving A/B of the final tree (tails off), chat:32 and nano:256, 2048 requests a run
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && export SHARED_BYTES=17179869184 OWN_BYTES=8589934592
git log --oneline -1 2>/dev/null > $OUT/tree.txt || true
OUT=$OUT/ab NUM_REQUESTS=2048 DURATION=12 RUNS=5 POINTS="chat:32 nano:256" timeout 570 bash bench/gpu_shared_kv.sh ab > $OUT/ab.txt 2>&1
echo "t=$SECONDS"
cp $OUT/ab/ab_rows.txt $OUT/ 2>/dev/null
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
grep -A5 "^workload" $OUT/ab.txt; grep -E "^ +32 " $OUT/ab.txt; grep -iE "MiB|engine|daemon" $OUT/ab.txt | head -20
