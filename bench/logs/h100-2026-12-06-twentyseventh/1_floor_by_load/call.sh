#!/usr/bin/env bash
# twenty-seventh session, call 1: the failover at 256 streams with the bench's new figure (what a kill added to
# each stream); every GPU-marked test (pytest -m gpu: what CI skips without a GPU); the failover at 64 streams
# (shared KV only, 20 SIGKILLs a load; .ab/call19.sh runs the loads and prints bench/probes/quiet_floor.py's table)
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep "Model name" | tee -a $OUT/gpu.txt
FAILOVER_TIMEOUT=240 LOADS=256 bash .ab/call19.sh
echo "t=$SECONDS"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests > $OUT/gpu_tests.txt 2>&1; echo "pytest rc=$?"; tail -4 $OUT/gpu_tests.txt
echo "t=$SECONDS"
LOADS=64 bash .ab/call19.sh
echo "t=$SECONDS"
python3 bench/probes/quiet_floor.py $OUT/s*.tgz
