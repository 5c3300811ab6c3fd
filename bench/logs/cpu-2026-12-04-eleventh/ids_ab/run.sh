#!/bin/bash
# CPU A/B of the router's ids out of the collector's walk: base f21a439 (lists) vs this tree (arrays,
# Fragment prompts); forced full collection every 10 s at 256 streams, token prompts, tiny model.
L="--input-len 100:512 --output-len 100:512"
run() {  # run SIDE NAME ARGS...
  side=$1; name=$2; shift 2
  root=/work/main; [ $side = base ] && root=/tmp/base
  echo "=== $name ($side) $(date -u +%FT%TZ)"
  (cd $root && timeout 900 /work/main/.venv/bin/python bench/probes/router_heap.py -c /tmp/heap/node.yaml --streams 256 --procs 4 $L "$@" --out /tmp/heap/v4/$name 2>&1 | grep -v "^  [A-Za-z]")
}
for i in 1 2; do
  run base forced-base-$i --seconds 70 --census 10 --collect
  run new forced-new-$i --seconds 70 --census 10 --collect
done
