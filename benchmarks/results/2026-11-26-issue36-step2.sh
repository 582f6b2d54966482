#!/bin/bash
# Issue 36, second step: the code at HEAD (run from a worktree, so editing main
# meanwhile cannot change what is measured) against 995db38, Apache Kafka.
cd /work/bench-head
PY=/work/main/.venv/bin/python
R=/work/main/benchmarks/results
$PY -m bench.drain --broker kafka --records 30000 --repeat 3 --peers tight_loop librdkafka_loop \
  --baseline-path /work/base-995db38 --json $R/2026-11-26-cpu2-drain-kafka-digits-issue36-step2.json > /tmp/fb-digits.log 2>&1
$PY -m bench.drain --broker kafka --payload tensor --records 20000 --repeat 3 --peers \
  --baseline-path /work/base-995db38 --json $R/2026-11-26-cpu2-drain-kafka-tensor-issue36-step2.json > /tmp/fb-tensor.log 2>&1
$PY -m bench.latency --broker kafka --rate 1000 --records 10000 --peers --repeat 3 \
  --baseline-path /work/base-995db38 --json $R/2026-11-26-cpu2-latency-kafka-1000-issue36-step2.json > /tmp/fb-lat.log 2>&1
echo done > /tmp/fb-done
