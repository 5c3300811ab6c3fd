source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 420 python3 bench/probes/shared_kv_engine.py $M --streams 64 --pool-gib 32 --out $OUT/probe 2>&1 | tee $OUT/probe.txt | grep -v "^\s*$" | tail -40
for f in a b; do tail -n 4 $OUT/probe/$f.log | cut -c1-300; done

