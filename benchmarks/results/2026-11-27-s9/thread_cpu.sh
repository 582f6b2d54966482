#!/bin/bash
# per-thread CPU of the worker process during one drain
cd /work/main
RECORDS=${RECORDS:-150000}
.venv/bin/python -m bench.drain --broker kafka --records $RECORDS --repeat 1 --peers ${EXTRA:-} > /tmp/tc-drain.log 2>&1 &
D=$!
pid=""
while kill -0 $D 2>/dev/null; do
  [ -z "$pid" ] && pid=$(pgrep -f "worker.__main__ import main|-m worker run" | head -1)
  if [ -n "$pid" ]; then
    for t in /proc/$pid/task/*; do echo "$(date +%s.%N) $(basename $t) $(cat $t/comm) $(awk '{print $14, $15}' $t/stat)"; done
  fi
  sleep 1
done > /tmp/tc-samples.txt 2>/dev/null
grep -E "worker  " /tmp/tc-drain.log
