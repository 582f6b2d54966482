#!/bin/bash
# Profile each worker process of one bench.drain run (current, then baseline) with py-spy.
cd /work/main
.venv/bin/python -m bench.drain --broker kafka --records 100000 --repeat 1 --peers --baseline-path /work/base-995db38 --json /tmp/prof-drain.json > /tmp/prof-drain.log 2>&1 &
DRAIN=$!
seen=""
while kill -0 $DRAIN 2>/dev/null; do
  for pid in $(pgrep -f "worker.__main__ import main|-m worker run"); do
    case " $seen " in *" $pid "*) continue;; esac
    seen="$seen $pid"
    tag=$(grep -q base-995db38 /proc/$pid/cmdline 2>/dev/null && echo base || echo new)
    (sleep 4; .venv/bin/py-spy record --pid $pid --duration 14 --rate 250 --format raw -o /tmp/prof-$tag-$pid.txt >/tmp/pyspy-$tag.log 2>&1) &
  done
  sleep 0.5
done
wait
