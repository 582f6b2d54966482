#!/bin/bash
# usage: pin_run.sh OUTTAG args... : bench.lanes with everything on CPU 0 but the worker processes, moved to CPU 1
cd ${WT:-/work/main}
TAG=$1; shift
( while true; do for p in $(pgrep -f "worker.__main__ import main|-m worker run"); do taskset -a -p -c 1 $p >/dev/null 2>&1; done; sleep 0.2; done ) &
W=$!
PYTHONPATH=$PWD taskset -c 0 /work/main/.venv/bin/python -m bench.lanes "$@" 2>&1 | grep -E "^  (lanes|urgent|no-lanes|capacity)" | sed -E "s/\(inside.*\); bulk/bulk/; s/^/$TAG /"
kill $W
