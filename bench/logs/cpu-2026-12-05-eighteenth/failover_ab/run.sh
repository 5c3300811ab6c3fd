#!/bin/bash
# A/B on the dev VM: base 2fe08f9 (.ab/base18) vs head (working tree), alternating, 8 kills each.
ARGS="bench failover -c /tmp/cpu_fo256.yaml --streams 256 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5"
for round in 1 2; do
  for side in base head; do
    rm -rf /tmp/rt-fo; out=/tmp/ab18/$side$round; mkdir -p $out
    if [ $side = base ]; then tree=/work/main/.ab/base18; else tree=/work/main; fi
    echo "== $side$round $(date -u +%FT%TZ)"
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m supervisor.cli $ARGS --out $out) > /tmp/ab18/$side$round.txt 2>&1
    echo "rc=$?"; tail -3 /tmp/ab18/$side$round.txt | cut -c1-400
  done
done
