#!/bin/bash
# Re-run of the CPU A/B with lengths the tiny model's 1024-token context takes (the first runs asked
# up to 1024+1024: ~60% of requests were refused at once with a 400). Base (0f6999f) vs this tree.
L="--input-len 100:512 --output-len 100:512"
run() {  # run SIDE NAME ARGS...
  side=$1; name=$2; shift 2
  root=/work/main; [ $side = base ] && root=/tmp/base
  echo "=== $name ($side) $(date -u +%FT%TZ)"
  (cd $root && timeout 900 /work/main/.venv/bin/python bench/probes/router_heap.py -c /tmp/heap/node.yaml --streams 256 --procs 4 $L "$@" --out /tmp/heap/v2/$name 2>&1 | grep -v "^busy\|^  [A-Za-z]")
}
for i in 1 2; do
  run base natural-base-$i --seconds 120 --census 10
  run new natural-new-$i --seconds 120 --census 10
done
for i in 1 2; do
  run base forced-base-$i --seconds 90 --census 10 --collect
  run new forced-new-$i --seconds 90 --census 10 --collect
done
run base cycles-base --seconds 60 --census 10 --cycles 25
run new cycles-new-kill --seconds 60 --census 10 --cycles 25 --kill 15
