#!/bin/bash
# usage: probe_ab.sh ROUNDS OUT worktree...  (each worktree's bench.lanes + worker, with the stage probe)
R=$1; OUT=$2; shift 2; mkdir -p $OUT
for i in $(seq $R); do for wt in "$@"; do
  tag=$(basename $wt); rm -f /tmp/probe.* /tmp/dump.*
  (cd $wt && PYTHONPATH=$wt PROBE_FILE=/tmp/probe DUMP_FILE=/tmp/dump /work/main/.venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 1 --only lanes --capacity 8700 2>&1 | grep -E "^  lanes" | sed -E "s/^/$tag $i /; s/queue ms.*loop/loop/")
  for f in /tmp/probe.*; do [ -s $f ] && /work/main/.venv/bin/python benchmarks/results/2026-11-27-s3/lanes_stage_probe.py /tmp/dump.lanes-0 $f | tee $OUT/$tag-$i.txt; done
done; done
