#!/bin/bash
# Alternating: the worker at Python's default GIL switch interval (5 ms) and at 1 ms.
cd /work/main
D=/work/devruns/swi; mkdir -p $D
for round in 1 2; do
  for v in 0.005 0.001; do
    [ $round = 2 ] && v=$([ $v = 0.005 ] && echo 0.001 || echo 0.005)
    timeout 600 .venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 1 \
      --only urgent-alone lanes --capacity 9000 --env PYTHONPATH=benchmarks/results/2026-11-27-s5/switch-interval --env SWITCH_INTERVAL=$v \
      --json $D/r$round-$v.json 2> $D/r$round-$v.err > /dev/null
    echo "round $round switch $v"; grep -E "urgent-alone|lanes " $D/r$round-$v.err | cut -c1-240
  done
done
