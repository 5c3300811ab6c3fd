#!/usr/bin/env bash
# failover_seconds of every kill of this session's seven runs, from each run's supervisor.log
# ("is primary (epoch N, exit, X ms after detection)"), pooled: failover_pooled.txt
cd "$(dirname "$0")" && d=$(mktemp -d) && n=0
for t in 1_core_line/streams.tgz 2_tokens_that_end_a_stall/instr.tgz 2_tokens_that_end_a_stall/fix.tgz \
         3_every_token_a_chunk_ab/before.tgz 3_every_token_a_chunk_ab/after.tgz 4_loop_watch/streams.tgz \
         5_detection_timed/streams.tgz; do
  n=$((n + 1)); mkdir "$d/$n"; tar xzf "$t" -C "$d/$n"
  tar xzf "$(find "$d/$n" -name 'logs-*.tgz')" -C "$d/$n" supervisor.log
  grep -o "exit, [0-9.]* ms after detection" "$d/$n/supervisor.log" | awk -v t="$t" '{print $2, t}'
done | sort -g > /tmp/failover_pooled.txt
python3 - <<'PY'
import math, statistics
xs = sorted(float(line.split()[0]) for line in open("/tmp/failover_pooled.txt"))
n = len(xs)
print(f"n {n}; median {statistics.median(xs)} ms; p99 (nearest rank) {xs[math.ceil(0.99 * n) - 1]} ms; "
      f"max {xs[-1]} ms; over 50 ms: {sum(x > 50 for x in xs)}; the five longest {xs[-5:]}")
PY
