#!/usr/bin/env bash
# Issue 53's A/B on CPU (no GPU lent): the tree the house-order review read (37604ce) against this one, the
# failover bench in turn (ABAB), same venv, tiny default model, float32.
set -u
PY=/work/main/.venv/bin/python
one() {  # one LABEL DIR ARGS...
  local label=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH="$dir" $PY -m supervisor bench failover "$@" --json) > "/tmp/ab53/$label.json" 2> "/tmp/ab53/$label.err"
  echo "$label rc=$?"
}
for round in 1 2; do
  for side in base new; do
    dir=$([ $side = base ] && echo /tmp/base53 || echo /work/main)
    one "plain_${side}_$round" "$dir" --runs 10
    one "streams_${side}_$round" "$dir" --streams 16 --runs 5 --input-len 20:100 --output-len 50:150 --warmup 3
  done
done
#!/usr/bin/env bash
set -u
PY=/work/main/.venv/bin/python
for round in 3 4; do
  for side in base new; do
    dir=$([ $side = base ] && echo /tmp/base53 || echo /work/main)
    (cd "$dir" && PYTHONPATH="$dir" $PY -m supervisor bench failover --runs 10 --json) > "/tmp/ab53/plain_${side}_$round.json" 2> "/tmp/ab53/plain_${side}_$round.err"
    echo "plain_${side}_$round rc=$?"
  done
done
