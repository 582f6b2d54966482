cd /work/main
for v in normal two; do
  extra=""
  [ $v = two ] && extra="--env TWO_LANE=1 --env SWITCH_MS=0.5 --env PYTHONPATH=/tmp/twolane"
  timeout 1200 .venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 3 --only urgent-alone lanes --capacity 9000 $extra --json /tmp/tl/warm-$v.json > /tmp/tl/warm-$v.log 2>&1
  echo "$v $(date +%T)"
done
