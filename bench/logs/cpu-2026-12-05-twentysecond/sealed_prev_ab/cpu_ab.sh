# The A/B as run on the dev VM (2026-12-05): /work/main at e5ef347 ("fix"), and .ab/s21 = a git archive of
# df8633e with e5ef347's harness/bench/failover_streams.py copied in ("base": the client's count of the
# continuations recomputing more than one token); cpu_fo.yaml (here) was at /tmp/cpu_fo.yaml.
set -u
for side in fix base fix2 base2; do
  dir=/work/main; case $side in base*) dir=/work/main/.ab/s21;; esac
  (cd $dir && PYTHONPATH=$dir timeout 1200 /work/main/.venv/bin/python -m supervisor.cli bench failover --json -c /tmp/cpu_fo.yaml --streams 64 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5 > /tmp/s22/ab_$side.json 2> /tmp/s22/ab_$side.log)
done
