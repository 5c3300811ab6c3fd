#!/bin/bash
# CPU A/B of the failover path: base (2fc8239, a git archive in /tmp/base) and ahead (/work/main, 2bec8d8),
# alternating; each side runs from its own folder (python -m puts the working directory first on sys.path)
for round in 1 2 3; do
  for side in base ahead; do
    src=/work/main; [ $side = base ] && src=/tmp/base
    out=/tmp/s26/$side-$round
    rm -rf $out /tmp/rt-fo24; mkdir -p $out
    start=$(date +%s)
    (cd $src && PYTHONPATH=$src /work/main/.venv/bin/python -m supervisor.cli bench failover --json -c /tmp/s24/cpu64.yaml \
      --streams 64 --client-procs 2 --input-len 100:400 --output-len 100:400 --runs 8 --warmup 5 --out $out \
      > $out/fo.json 2> $out/fo.log)
    echo "$side $round rc=$? $(( $(date +%s) - start ))s; engine lines naming requests sent ahead: $(tar xzOf $out/logs-shared_kv-true.tgz | grep -c 'sent ahead')"
  done
done
