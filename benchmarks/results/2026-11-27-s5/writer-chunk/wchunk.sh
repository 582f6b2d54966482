#!/bin/bash
cd /work/main
D=/work/devruns/wchunk; mkdir -p $D
for round in 1 2 3; do
  for v in base chunk; do
    if [ $((round % 2)) = 0 ]; then v=$([ $v = base ] && echo chunk || echo base); fi
    E=""; [ $v = chunk ] && E="--env X_CHUNK=32"
    timeout 600 .venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 1 \
      --only lanes --capacity 9000 $E --json $D/r$round-$v.json 2> $D/r$round-$v.err > /dev/null
    echo "round $round $v"; grep -E "lanes " $D/r$round-$v.err | cut -c1-250
  done
done
