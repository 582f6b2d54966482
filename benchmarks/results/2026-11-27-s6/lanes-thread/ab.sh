cd /work/main
for r in 1 2 3 4 5 6 7; do  # run as 1-3, then 4-7
  for v in normal two; do
    extra=""
    [ $v = two ] && extra="--env TWO_LANE=1 --env SWITCH_MS=0.5 --env PYTHONPATH=/tmp/twolane"
    timeout 900 .venv/bin/python -m bench.lanes --broker kafka --backlog 100000 --seconds 10 --repeat 1 --only urgent-alone lanes --capacity 9000 $extra --json /tmp/tl/ab-$v-$r.json > /tmp/tl/ab-$v-$r.log 2>&1
    echo "$v $r $(date +%T)"
  done
done
