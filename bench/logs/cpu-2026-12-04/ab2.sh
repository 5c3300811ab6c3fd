#!/bin/bash
# A/B with a full collection forced every 10 s (timed): base (0f6999f) vs this tree, alternating, 256 streams, 90 s each
for i in 1 2; do
  for side in base new; do
    root=/work/main; [ $side = base ] && root=/tmp/base
    echo "=== $side run $i $(date -u +%FT%TZ)"
    (cd $root && timeout 900 /work/main/.venv/bin/python bench/probes/router_heap.py -c /tmp/heap/node.yaml --streams 256 --procs 4 --seconds 90 --census 10 --collect --out /tmp/heap/ab2/$side-$i 2>&1 | grep -v "^  " | grep -v "^busy")
  done
done
