#!/bin/bash
# CPU serving A/B: base 2fe08f9 vs head, alternating, chat c=32, 40 s each, 2 client processes.
PY=/work/main/.venv/bin/python
for round in 3 4 5; do
  for side in head base; do
    if [ $side = base ]; then tree=/work/main/.ab/base18; else tree=/work/main; fi
    rm -rf /tmp/rt-sv
    (cd $tree && PYTHONPATH=$tree exec $PY -m supervisor.cli serve -c /tmp/cpu_serve.yaml) > /tmp/ab18/serve-$side$round.log 2>&1 &
    pid=$!
    for i in $(seq 120); do curl -sf http://127.0.0.1:18000/readyz >/dev/null 2>&1 && break; sleep 1; done
    sleep 3
    echo "== $side$round $(date -u +%FT%TZ)"
    (cd $tree && PYTHONPATH=$tree $PY -m supervisor.cli bench serve -c /tmp/cpu_serve.yaml --workload chat --concurrency 32 --duration 40 --client-procs 2 --no-static --warmup 8) > /tmp/ab18/bench-$side$round.txt 2>&1
    echo "rc=$?"; grep -i "tok/s\|output" /tmp/ab18/bench-$side$round.txt | head -5
    kill -TERM $pid; wait $pid
  done
done
