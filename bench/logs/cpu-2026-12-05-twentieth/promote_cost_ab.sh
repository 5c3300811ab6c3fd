#!/bin/bash
# promote_cost.py: base 06f9e9e (its own probe: a pool of sealed blocks) against head with --tails (each stream's
# last partial block named as a tail, and blocks left FREE for the copies), in turn, two rounds.
L=/work/main/bench/logs/cpu-2026-12-05-twentieth
for round in 1 2; do for side in base head-tails; do
  tree=/work/main; args="--tails"; [ $side = base ] && tree=/work/main/.ab/base20 && args=""
  echo "== $side round $round: (cd $tree/bench/probes && python promote_cost.py --runs 5 $args)"
  (cd $tree/bench/probes && PYTHONPATH=$tree /work/main/.venv/bin/python promote_cost.py --runs 5 $args 2>&1 | tail -1)
done; done 2>&1 | tee $L/promote_cost_ab.txt
