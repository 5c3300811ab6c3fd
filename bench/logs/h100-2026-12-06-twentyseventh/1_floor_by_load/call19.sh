#!/usr/bin/env bash
# the gap across a kill and at quiet moments by load ($LOADS streams; shared KV only, 20 SIGKILLs each, in turn;
# COMPARE=--compare: shared_kv: false beside each); a .tgz per load in $OUT, the table last
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
base=$OUT
for n in ${LOADS:-32 64 128}; do
  mkdir -p $base/s$n
  OUT=$base/s$n STREAMS=$n FAILOVER_TIMEOUT=${FAILOVER_TIMEOUT:-170} RUNS=20 COMPARE=${COMPARE-} bash bench/gpu_shared_kv.sh failover > $base/s$n/failover.txt 2>&1
  echo "streams $n: t=$SECONDS"
  tar czf $base/s$n.tgz -C $base s$n && rm -rf $base/s$n
done
python3 bench/probes/quiet_floor.py $base/s*.tgz
