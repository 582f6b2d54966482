#!/usr/bin/env bash
# Everything issue 9 needs from a GPU machine, in one call of the device tool:
#
#   run(command="bash scripts/gpu_session.sh tests", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_session.sh bench1", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_session.sh bench2", carry=[".whl"], timeout_s=600)
#
# Each phase is sized for one 10-minute call (a fresh machine compiles
# ResNet-50 again; the inductor cache only lives through one call), and every
# command in it has a timeout inside that, writing its whole log under $OUT as
# it goes, so a slow step still returns what ran before it. Phases:
# `tests`: the whole tests/gpu suite and the torch export tests; `bench1`: the
# GPU benchmark (ResNet-50) with JPEG and raw payloads, 1 process; `bench2`: JPEG
# with 2 and 4 processes; `profile`: py-spy (carried in .whl) over a JPEG
# benchmark and its worker processes. Logs and JUnit XML go to $OUT (default
# ./gpu-out), the benchmark JSON to $OUT/results (copy it to benchmarks/results/).
#
# The device machine has Python 3.12 with torch, torchvision, CuPy and the rest
# (see the device README); the worker's Kafka-side dependencies travel as wheels
# in .whl/ (downloaded here with `pip download`, see the device README), installed
# into /tmp/site. The checkout is used in place: no pip install of the project
# (the machine has no network, and the packaging test fails there for that reason).
set -uo pipefail

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH
# Compiled kernels are cached per call; a later phase reuses the earlier ones.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests)
status=0

for phase in "${phases[@]}"; do
    case "$phase" in
    tests)
        # The ResNet-50 end-to-end test last, so a slow start-up there cannot
        # cost the rest of the suite its results.
        e2e=tests/gpu/test_gpu_modelbench.py::test_resnet50_jpeg_bench_end_to_end
        timeout 330 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu tests/unit/engines \
            --deselect "$e2e" --durations 15 --junitxml="$OUT/gpu-tests.xml" -o log_cli=false \
            >"$OUT/gpu-tests.txt" 2>&1
        [ $? -eq 0 ] || status=1
        timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider "$e2e" --durations 5 \
            >"$OUT/gpu-tests-e2e.txt" 2>&1
        [ $? -eq 0 ] || status=1
        tail -n 40 "$OUT/gpu-tests.txt" "$OUT/gpu-tests-e2e.txt"
        ;;
    bench1 | bench2)
        mkdir -p "$OUT/results"
        # "seconds arguments": the first run of a call compiles ResNet-50 for
        # every bucket from cold (later processes hit the inductor cache), so
        # it gets the larger share of the call's 10 minutes.
        if [ "$phase" = bench1 ]; then
            runs=("340 --payload jpeg --procs 1" "220 --payload raw --procs 1")
        else
            runs=("320 --payload jpeg --procs 2" "240 --payload jpeg --procs 4")
        fi
        for run in "${runs[@]}"; do
            # The full log goes to $OUT as it is written: a run stopped by its
            # timeout still leaves it, and the JSON of the runs before it.
            # shellcheck disable=SC2086
            timeout ${run%% *} python3 -m worker bench --model resnet50 ${run#* } \
                --partitions 8 --results-dir "$OUT/results" >>"$OUT/$phase.txt" 2>&1
            [ $? -eq 0 ] || status=1
        done
        tail -n 60 "$OUT/$phase.txt"
        ;;
    profile)
        # Raw collapsed stacks of the bench process and its workers (--subprocesses);
        # summarise the top frames here, after fetching.
        timeout 540 py-spy record --subprocesses --rate 50 --format raw -o "$OUT/profile.txt" -- \
            python3 -m worker bench --model resnet50 --payload jpeg --procs 1 --partitions 8 \
            --results-dir "$OUT/results" >"$OUT/profile-bench.txt" 2>&1
        [ $? -eq 0 ] || status=1
        tail -n 40 "$OUT/profile-bench.txt"
        ;;
    *)
        echo "unknown phase $phase (tests | bench1 | bench2 | profile)" >&2
        exit 2
        ;;
    esac
done
exit $status
