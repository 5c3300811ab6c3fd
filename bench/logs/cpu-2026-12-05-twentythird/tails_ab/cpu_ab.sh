# The A/B as run on the dev VM (2026-12-05, twenty-third session): /work/main at a62a50e, engines.kv_tails
# off (cpu_fo.yaml, the default) and on (cpu_fo_tails.yaml), alternating; the configs were at /tmp/s23/.
set -u
for side in off on off2 on2; do
  cfg=/tmp/s23/cpu_fo.yaml; case $side in on*) cfg=/tmp/s23/cpu_fo_tails.yaml;; esac
  (cd /work/main && PYTHONPATH=/work/main timeout 1200 .venv/bin/python -m supervisor.cli bench failover --json -c $cfg --streams 64 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5 > /tmp/s23/ab_$side.json 2> /tmp/s23/ab_$side.log)
done
