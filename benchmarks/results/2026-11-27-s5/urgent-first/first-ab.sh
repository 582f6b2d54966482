#!/bin/bash
# Alternating rounds: the urgent-first loop (main) against the commit before (05c80f8).
D=/work/devruns/first; mkdir -p $D
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="/work/main /work/base-05c"; else order="/work/base-05c /work/main"; fi
  for wt in $order; do
    tag=$(basename $wt)
    (cd $wt && PYTHONPATH=$wt /work/main/.venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 1 \
      --only urgent-alone lanes --capacity 9000 --json $D/$tag-$round.json 2> $D/$tag-$round.err > /dev/null)
    echo "round $round $tag"; grep -E "urgent-alone|lanes " $D/$tag-$round.err | cut -c1-250
  done
done
