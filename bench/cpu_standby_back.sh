#!/usr/bin/env bash
# Standby back (kill of the primary -> its replacement READY) on this machine's CPU, tiny model: an older
# tree's files in $1 (git archive of a commit) and this tree in turn, ROUNDS times, `bench failover --runs
# RUNS` each; every "replacement READY in" figure, then the median and max per side.
#   bash bench/cpu_standby_back.sh .ab/base > OUT.txt
set -u
BASE=$1; ROUNDS=${ROUNDS:-4}; RUNS=${RUNS:-5}; PY=$PWD/.venv/bin/python
MODEL=${MODEL:-/tmp/tiny}; [ -f $MODEL/config.json ] || $PY -m engines.make_model $MODEL --preset tiny >/dev/null
printf 'runtime_dir: /tmp/rt-standby-back\nmodel:\n  path: %s\nrouter:\n  port: 18100\nadmin:\n  port: 18101\n' $MODEL \
  > /tmp/standby-back.yaml
for i in $(seq "$ROUNDS"); do
  for side in base this; do
    dir=$([ $side = base ] && echo "$BASE" || echo .)
    (cd "$dir" && timeout 300 $PY -m supervisor.cli bench failover -c /tmp/standby-back.yaml --runs "$RUNS" 2>&1) \
      | grep -o "replacement READY in [0-9.]* s" | awk -v s=$side '{print s, $4}'
  done
done | tee /tmp/standby-back-rows.txt
$PY - /tmp/standby-back-rows.txt <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
for side in ("base", "this"):
    v = [float(x[1]) for x in rows if x[0] == side]
    print(f"{side}: replacement READY, median {statistics.median(v):.2f} s, max {max(v):.2f} s (n {len(v)})")
PY
