#!/usr/bin/env bash
# A restarted engine's graph capture on one H200 (device tool), 1b preset, 256 sequences, 2048-token
# steps: bench/probes/graph_warmup.py in fresh processes. The first run (--warm path, so that a cold
# Triton cache compiles some kernels inside captures) fills the disk cache and is left out; then a
# warm-up before every graph ("all", the runner before) and before the first graph of each forward
# path ("path", the runner now) in turn, $RUNS times each; then the GPU tests (TESTS= skips them).
source bench/gpu_env.sh
P="python3 bench/probes/graph_warmup.py $M"
$P --warm path > "$OUT/cold.txt" 2>&1 || { tail -20 "$OUT/cold.txt"; exit 1; }
for i in $(seq "${RUNS:-3}"); do
  for w in all path; do
    $P --warm $w > "$OUT/$w-$i.txt" 2>&1
    echo "$w $i $(grep -h '^total' "$OUT/$w-$i.txt")"
  done
done | tee "$OUT/table.txt"
if [ -n "${TESTS-tests/test_engine_gpu.py tests/test_supervisor_gpu.py}" ]; then
  timeout 300 python3 -m pytest -q ${TESTS-tests/test_engine_gpu.py tests/test_supervisor_gpu.py} 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.txt"
fi
