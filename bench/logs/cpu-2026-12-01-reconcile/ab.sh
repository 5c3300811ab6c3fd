#!/bin/bash
# kill -> first success, two checkouts side by side, alternating (CPU, embedded default model):
#   bash ab.sh MAIN_CHECKOUT RECONCILE_CHECKOUT OUT_DIR   (one venv's python, PY, runs both trees)
PY=${PY:-python3}
for round in 1 2; do
  for side in main reconcile; do
    dir=$1; [ $side = reconcile ] && dir=$2
    (cd "$dir" && $PY -m supervisor bench failover --runs 15 --overhead-requests 0 --json \
       > "$3/failover_$side-$round.json" 2> "$3/failover_$side-$round.log")
    echo "$side $round rc=$?"
  done
done
