set -u
for side in fix base fix2 base2; do
  dir=/work/main; case $side in base*) dir=.ab/s21 (git archive of df8633e, with this tree's harness/bench/failover_streams.py);; esac
  (cd $dir && PYTHONPATH=$dir timeout 1200 /work/main/.venv/bin/python -m supervisor.cli bench failover --json -c /tmp/cpu_fo.yaml --streams 64 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5 > /tmp/s22/ab_$side.json 2> /tmp/s22/ab_$side.log)
done
