#!/bin/bash
# Profile the worker process of one bench.drain run with py-spy (the working tree's code only).
# Usage: [RECORDS=100000] [EXTRA="--payload tensor"] [GIL=1] [NATIVE=1] [WT=<worktree>] \
#        benchmarks/results/2026-11-26-pyspy-drain-current.sh TAG
# GIL=1: sample only the thread holding the GIL (py-spy --gil; since 2026-11-27:
# a thread waiting for the GIL otherwise counts as busy). NATIVE=1: with C frames
# (py-spy --native; since 2026-11-27). WT: profile another
# checkout's code (a git worktree) with this checkout's virtual environment.
MAIN=/work/main
cd ${WT:-$MAIN}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TAG=${1:-cur}
rm -f /tmp/prof-$TAG-*.txt
$MAIN/.venv/bin/python -m bench.drain --broker kafka --records ${RECORDS:-100000} --repeat 1 --peers ${EXTRA:-} --json /tmp/prof-drain-$TAG.json > /tmp/prof-drain-$TAG.log 2>&1 &
DRAIN=$!
seen=""
while kill -0 $DRAIN 2>/dev/null; do
  for pid in $(pgrep -f "worker.__main__ import main|-m worker run"); do
    case " $seen " in *" $pid "*) continue;; esac
    seen="$seen $pid"
    (sleep 4; $MAIN/.venv/bin/py-spy record --pid $pid --duration 14 --rate 250 ${GIL:+--gil} ${NATIVE:+--native} --format raw -o /tmp/prof-$TAG-$pid.txt >/tmp/pyspy-$TAG.log 2>&1) &
  done
  sleep 0.5
done
wait
