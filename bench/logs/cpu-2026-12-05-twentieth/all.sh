#!/bin/bash
# Twentieth session's CPU measurements on the dev VM, in one go (nothing else running).
L=/work/main/bench/logs/cpu-2026-12-05-twentieth
cd /work/main
/tmp/ab20/run.sh
echo "== probes $(date -u +%FT%TZ)"
for side in base head; do
  tree=/work/main; [ $side = base ] && tree=/work/main/.ab/base20
  echo "-- index_writes.py on $side"; (cd /work/main/bench/probes && PYTHONPATH=$tree /work/main/.venv/bin/python index_writes.py)
done 2>&1 | tee $L/index_writes_ab.txt
(cd bench/probes && PYTHONPATH=/work/main /work/main/.venv/bin/python tail_cost.py --runs 5 --steps 300) 2>&1 | tee $L/tail_cost.txt
for round in 1 2; do for side in base head head-tails; do
  tree=/work/main; args=""; [ $side = base ] && tree=/work/main/.ab/base20; [ $side = head-tails ] && args="--tails"
  echo "== $side round $round: promote_cost.py --runs 5 $args"
  (cd $tree/bench/probes && PYTHONPATH=$tree /work/main/.venv/bin/python /work/main/bench/probes/promote_cost.py --runs 5 $args 2>&1 | tail -1)
done; done 2>&1 | tee $L/promote_cost_ab.txt
echo "== done $(date -u +%FT%TZ)"
