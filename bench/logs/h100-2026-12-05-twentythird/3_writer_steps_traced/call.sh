#!/usr/bin/env bash
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 280 python3 bench/probes/writer_steps.py $M --pool-gib 16 --batch 32 --context 300 --steps 400 --rounds 3 > $OUT/writer_steps_32.txt 2>&1
echo "t=$SECONDS"
timeout $((520 - SECONDS)) python3 bench/probes/writer_steps.py $M --pool-gib 16 --batch 256 --context 300 --steps 200 --rounds 2 > $OUT/writer_steps_256.txt 2>&1
echo "t=$SECONDS"
tail -16 $OUT/writer_steps_32.txt; tail -16 $OUT/writer_steps_256.txt
