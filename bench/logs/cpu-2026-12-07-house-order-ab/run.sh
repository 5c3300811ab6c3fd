#!/usr/bin/env bash
# run.sh SIDE DIR: the failover bench from that tree's own folder (its code first on sys.path)
cd "$2" && PYTHONPATH="$2" /work/main/.venv/bin/python -m supervisor.cli bench failover --preset tiny --device cpu \
  --runs 10 --streams 8 --client-procs 2 --input-len 32 --output-len 64 --json > /tmp/ab/$1.json 2> /tmp/ab/$1.log
echo "$1 rc=$?"
