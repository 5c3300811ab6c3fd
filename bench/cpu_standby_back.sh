#!/usr/bin/env bash
# Standby back (kill of the primary -> its replacement READY) on this machine's CPU, tiny model: an older
# tree's files in $1 (git archive of a commit) and this tree in turn, ROUNDS times, `bench failover --runs
# RUNS` each; every "replacement READY in" figure, then the median and max per side, and from the
# engines' logs the median server_ready and tokenizer phases and the collections over 10 ms.
#   bash bench/cpu_standby_back.sh .ab/base > OUT.txt
set -u
BASE=$1; ROUNDS=${ROUNDS:-4}; RUNS=${RUNS:-5}; PY=$PWD/.venv/bin/python
MODEL=${MODEL:-/tmp/tiny}; [ -f $MODEL/config.json ] || $PY -m supervisor.cli make-model $MODEL --preset tiny >/dev/null
printf 'model:\n  path: %s\nrouter:\n  port: 18100\nadmin:\n  port: 18101\n' $MODEL \
  > /tmp/standby-back.yaml
rm -f /tmp/standby-back-phases.txt
for i in $(seq "$ROUNDS"); do
  for side in base this; do
    dir=$([ $side = base ] && echo "$BASE" || echo .)
    (cd "$dir" && timeout 300 $PY -m supervisor.cli bench failover -c /tmp/standby-back.yaml --runs "$RUNS" 2>&1) \
      | grep -o "replacement READY in [0-9.]* s" | awk -v s=$side '{print s, $4}'
    cat "$(ls -td /tmp/understudy-bench-*/ | head -1)"rt/logs/[ab]-*.log | awk -v s=$side '/^(server_ready|tokenizer) /{print s, $1, $2}
      /garbage collection/{print s, "collection", $0}' >> /tmp/standby-back-phases.txt
  done
done | tee /tmp/standby-back-rows.txt
grep collection /tmp/standby-back-phases.txt
$PY - /tmp/standby-back-rows.txt /tmp/standby-back-phases.txt <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
phases = [line.split(maxsplit=2) for line in open(sys.argv[2])]
for side in ("base", "this"):
    v = [float(x[1]) for x in rows if x[0] == side]
    print(f"{side}: replacement READY, median {statistics.median(v):.2f} s, max {max(v):.2f} s (n {len(v)})")
    for name in ("server_ready", "tokenizer"):
        p = [float(x[2]) for x in phases if x[0] == side and x[1] == name]
        print(f"{side}: {name} median {statistics.median(p):.3f} s, max {max(p):.3f} s (n {len(p)} engine starts)")
    print(f"{side}: collections over 10 ms logged by engines: {sum(x[0] == side and x[1] == 'collection' for x in phases)}")
PY
