source bench/gpu_env.sh
C=/tmp/h200.yaml
sed "s#preset: 1b#path: $M#" configs/h200-1b.yaml > $C
for where in ${WHERES:-router engine}; do
  T=/tmp/trace_${where}_$RANDOM; mkdir -p $T; export UNDERSTUDY_TTFT_TRACE=$T
  start_serve $C "$OUT/serve_$where.log"
  url=$(python3 -m supervisor.cli status -c $C --json | python3 -c "import json,sys; print([e['url'] for e in json.load(sys.stdin)['engines'] if e['role']=='primary'][0])")
  B="python3 -m supervisor.cli bench serve -c $C --client-procs 8 --workload shared-prefix --no-static --duration 15 --concurrency ${CONC:-32}"

  timeout 100 $B $([ $where = engine ] && echo "--url $url") 2>/dev/null | tail -2
  echo "== $where"; python3 _ttft_analyze.py $T
  kill -TERM $sup; wait $sup
done
