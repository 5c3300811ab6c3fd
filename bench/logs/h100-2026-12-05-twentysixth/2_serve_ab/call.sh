#!/usr/bin/env bash
# twenty-sixth session, call 2: serving A/B of the final tree (shared_kv on/off on one card), chat:32 and nano:256
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep "Model name" | tee -a $OUT/gpu.txt
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && export SHARED_BYTES=17179869184 OWN_BYTES=8589934592
OUT=$OUT/ab NUM_REQUESTS=2048 DURATION=12 RUNS=5 POINTS="chat:32 nano:256" timeout 570 bash bench/gpu_shared_kv.sh ab > $OUT/ab.txt 2>&1
echo "t=$SECONDS"
cp $OUT/ab/ab_rows.txt $OUT/ 2>/dev/null
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
grep -A5 "^workload" $OUT/ab.txt; grep -E "^ +32 " $OUT/ab.txt; grep -iE "MiB|engine|daemon" $OUT/ab.txt | head -20
