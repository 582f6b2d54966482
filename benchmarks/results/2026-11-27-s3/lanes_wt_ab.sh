#!/bin/bash
# usage: lanes_wt_ab.sh ROUNDS CAP OUTDIR worktree...   (main's bench.lanes against each worktree's worker)
R=$1; CAP=$2; OUT=$3; shift 3; mkdir -p $OUT
for i in $(seq $R); do
  for wt in "$@"; do
    tag=$(basename $wt)
    (cd $wt && PYTHONPATH=$wt /work/main/.venv/bin/python /work/main/bench/lanes.py --broker kafka --backlog 100000 --seconds 10 --repeat 1 --only lanes --capacity $CAP --json $OUT/$tag-$i.json 2>&1 | grep -E "^  lanes" | sed -E "s/^/$tag $i /; s/queue ms.*loop/loop/")
  done
done
