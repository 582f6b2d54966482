#!/bin/bash
# usage: nice_run.sh TAG args... : bench.lanes (and its broker) at nice 10, the worker processes at nice 0
cd ${WT:-/work/main}
TAG=$1; shift
( while true; do for p in $(pgrep -f "worker.__main__ import main|-m worker run"); do for t in /proc/$p/task/*; do renice -n 0 -p ${t##*/} >/dev/null 2>&1; done; done; sleep 0.2; done ) &
W=$!
PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python -m bench.lanes "$@" 2>&1 | grep -E "^  (lanes|urgent|no-lanes|capacity)" | sed -E "s/\(inside.*\); bulk/bulk/; s/^/$TAG /"
kill $W
