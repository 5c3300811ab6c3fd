#!/bin/bash
# Twentieth session's CPU measurements on the dev VM on the final tree, in one go (nothing else running).
L=/work/main/bench/logs/cpu-2026-12-05-twentieth
cd /work/main
/tmp/ab20/run.sh
mkdir -p $L/failover_tails_ab && cp -r /tmp/ab20/base? /tmp/ab20/head? /tmp/ab20/base?.txt /tmp/ab20/head?.txt /tmp/ab20/order.txt /tmp/ab20/run.sh /tmp/ab20/summary.py $L/failover_tails_ab/
(cd /tmp/ab20 && python3 summary.py base1 head1 base2 head2 base3 head3) > $L/failover_tails_ab/summary.txt
echo "== probes $(date -u +%FT%TZ)"
for side in base head; do
  tree=/work/main; [ $side = base ] && tree=/work/main/.ab/base20
  echo "-- index_writes.py on $side"; (cd /work/main/bench/probes && PYTHONPATH=$tree /work/main/.venv/bin/python index_writes.py)
done 2>&1 | tee $L/index_writes_ab.txt
(cd bench/probes && PYTHONPATH=/work/main /work/main/.venv/bin/python tail_cost.py --runs 5 --steps 300) 2>&1 | tee $L/tail_cost.txt
/tmp/ab20/pc.sh
for round in 1 2; do for side in base head-tails; do tree=/work/main; args="--tails"; [ $side = base ] && tree=/work/main/.ab/base20 && args=""
  echo "== $side round $round: (cd $tree/bench/probes && python core_admission.py --runs 5 $args)"
  (cd $tree/bench/probes && PYTHONPATH=$tree /work/main/.venv/bin/python core_admission.py --runs 5 $args 2>&1 | tail -1)
done; done 2>&1 | tee $L/core_admission_ab.txt
echo "== done $(date -u +%FT%TZ)"
