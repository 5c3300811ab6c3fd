#!/bin/bash
# A/B on the dev VM: base 06f9e9e (.ab/base20) vs head (working tree: tails), alternating, 8 kills each.
ARGS="bench failover --json -c /tmp/cpu_fo.yaml --streams 64 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5"
for round in 1 2 3; do
  for side in base head; do
    rm -rf /tmp/rt-fo; out=/tmp/ab20/$side$round; mkdir -p $out
    if [ $side = base ]; then tree=/work/main/.ab/base20; else tree=/work/main; fi
    echo "== $side$round $(date -u +%FT%TZ)" | tee -a /tmp/ab20/order.txt
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m supervisor.cli $ARGS --out $out) > /tmp/ab20/$side$round.txt 2>&1
    echo "rc=$?" | tee -a /tmp/ab20/order.txt; tail -1 /tmp/ab20/$side$round.txt | cut -c1-600
  done
done
