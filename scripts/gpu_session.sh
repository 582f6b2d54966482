#!/usr/bin/env bash
# Everything issue 9 (and 22) needs from a GPU machine, in three calls of the
# device tool, each well inside its 10-minute limit:
#
#   run(command="bash scripts/gpu_session.sh tests", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_session.sh bench1", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_session.sh bench2", carry=[".whl"], timeout_s=600)
#
# Phases: `tests`: the whole tests/gpu suite and the torch engine tests, the
# ResNet-50 end-to-end test last; `bench1`: the GPU benchmark (ResNet-50) with
# JPEG and raw payloads, 1 process; `bench2`: JPEG with 2 and 4 processes;
# `profile` (a fourth call, optional): py-spy (carried in .whl) over a JPEG
# benchmark and its worker processes. `budgets` prints the table below and
# checks it, without a GPU (tests/unit/test_gpu_session.py runs it).
#
# Every step runs under `timeout` with its own budget (BUDGET below), SIGKILL
# KILL_AFTER_S later if it has not stopped; a tool stopped so kills its broker
# and workers before it exits (worker.ops.children), so no step runs on into
# the next. Each step's log goes under $OUT as it is written, so a stopped step
# still returns its log and the results of the steps before it; each step's
# budget, measured seconds and status go to $OUT/steps.tsv.
#
# The budgets are ESTIMATES: no step has run on a GPU yet (the machine lent so
# far had no time for it). Replace them with steps.tsv's measured seconds plus
# a margin after the first session. A phase's steps, its set-up and a
# KILL_AFTER_S per step add up to at most CALL_S - SPARE_S: the spare covers
# the command's start, $OUT's transfer, and estimates that run long.
#
# The device machine has Python 3.12 with torch, torchvision, CuPy and the rest
# (see the device README); the worker's Kafka-side dependencies travel as wheels
# in .whl/ (downloaded here with `pip download`, see the device README), installed
# into /tmp/site, which joins PYTHONPATH (extended, never replaced: every child
# inherits it). The checkout is used in place: no pip install of the project
# (the machine has no network, and the packaging test fails there for that reason).
set -uo pipefail

CALL_S=600
SPARE_S=60
KILL_AFTER_S=5
# Seconds per step (estimates, see above). setup.* run in every phase.
declare -A BUDGET=(
    [setup.wheels]=40      # pip install of a few wheels from .whl, no network
    [setup.gpu]=10         # nvidia-smi
    [tests.suite]=210      # tests/gpu + tests/unit/compute/engines, small models
    [tests.e2e]=240        # ResNet-50 bench, uncompiled, 2 processes (its own timeout: 200)
    [bench1.jpeg1]=245     # cold call: export + the first compile, 80k JPEG records
    [bench1.raw1]=200      # warm cache; 23k raw records, 4.5 GB through the broker
    [bench2.jpeg2]=230     # cold call again; 160k JPEG records
    [bench2.jpeg4]=235     # warm cache; 200k JPEG records, 4 workers starting
    [profile.jpeg1]=460    # py-spy over bench1's first run
)
PHASES=(tests bench1 bench2 profile)

phase_total() {  # the worst case of one call: set-up and steps, each with its kill grace
    local phase=$1 total=0 key
    for key in "${!BUDGET[@]}"; do
        case "$key" in
        setup.* | "$phase".*) total=$((total + BUDGET[$key] + KILL_AFTER_S)) ;;
        esac
    done
    echo "$total"
}

check_budgets() {
    local phase total bad=0
    for phase in "${PHASES[@]}"; do
        total=$(phase_total "$phase")
        echo "$phase: $total s of $CALL_S (spare $((CALL_S - total)) s, at least $SPARE_S wanted)"
        [ "$total" -le $((CALL_S - SPARE_S)) ] || bad=1
    done
    return $bad
}

if [ "${1:-}" = budgets ]; then
    check_budgets
    exit $?
fi
check_budgets >/dev/null || { check_budgets; echo "a phase does not fit its call" >&2; exit 2; }

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
printf 'step\tbudget_s\tmeasured_s\tstatus\n' >>"$OUT/steps.tsv"
status=0

step() {  # step NAME LOG COMMAND...: run it under its budget, log, time and status recorded
    local name=$1 log=$2 start rc
    shift 2
    start=$SECONDS
    timeout -k "$KILL_AFTER_S" "${BUDGET[$name]}" "$@" >>"$log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "${BUDGET[$name]}" $((SECONDS - start)) "$rc" \
        | tee -a "$OUT/steps.tsv"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

if [ -d .whl ]; then
    step setup.wheels "$OUT/setup.txt" python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1
# One torch compile cache for the whole call, shared by every process it starts:
# the benchmark's engine-alone measurement compiles first, and each worker of
# `run --procs N` (and each later run and test of the call) finds the compiled
# graph in the FX graph and AOTAutograd caches and the kernels in Triton's,
# instead of compiling again. The machine is fresh each call: the cache lives
# one call.
export TORCHINDUCTOR_CACHE_DIR=/tmp/torch-compile-cache
export TORCHINDUCTOR_FX_GRAPH_CACHE=1
export TORCHINDUCTOR_AUTOGRAD_CACHE=1
export TRITON_CACHE_DIR=$TORCHINDUCTOR_CACHE_DIR/triton
step setup.gpu "$OUT/gpu.txt" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
cat "$OUT/gpu.txt"

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests)

bench() {  # bench STEP ARGS...: one ResNet-50 benchmark run
    step "$1" "$OUT/${1%%.*}.txt" python3 -m worker bench --model resnet50 "${@:2}" \
        --partitions 8 --results-dir "$OUT/results"
}

for phase in "${phases[@]}"; do
    case "$phase" in
    tests)
        # The ResNet-50 end-to-end test last, so a slow start-up there cannot
        # cost the rest of the suite its results.
        e2e=tests/gpu/test_gpu_modelbench.py::test_resnet50_jpeg_bench_end_to_end
        step tests.suite "$OUT/gpu-tests.txt" python3 -m pytest -q -rfEs -p no:cacheprovider \
            tests/gpu tests/unit/compute/engines --deselect "$e2e" --durations 15 \
            --junitxml="$OUT/gpu-tests.xml" -o log_cli=false
        step tests.e2e "$OUT/gpu-tests-e2e.txt" python3 -m pytest -q -rfEs \
            -p no:cacheprovider "$e2e" --durations 5
        tail -n 40 "$OUT/gpu-tests.txt" "$OUT/gpu-tests-e2e.txt"
        ;;
    bench1 | bench2)
        mkdir -p "$OUT/results"
        # The first run of a call compiles ResNet-50 from cold (later processes
        # and runs hit the cache), so it gets the larger budget.
        if [ "$phase" = bench1 ]; then
            bench bench1.jpeg1 --payload jpeg --procs 1
            bench bench1.raw1 --payload raw --procs 1
        else
            bench bench2.jpeg2 --payload jpeg --procs 2
            bench bench2.jpeg4 --payload jpeg --procs 4
        fi
        tail -n 60 "$OUT/$phase.txt"
        ;;
    profile)
        # Raw collapsed stacks of the bench process and its workers (--subprocesses);
        # summarise the top frames here, after fetching.
        mkdir -p "$OUT/results"
        step profile.jpeg1 "$OUT/profile-bench.txt" py-spy record --subprocesses --rate 50 \
            --format raw -o "$OUT/profile.txt" -- python3 -m worker bench --model resnet50 \
            --payload jpeg --procs 1 --partitions 8 --results-dir "$OUT/results"
        tail -n 40 "$OUT/profile-bench.txt"
        ;;
    *)
        echo "unknown phase $phase (tests | bench1 | bench2 | profile | budgets)" >&2
        exit 2
        ;;
    esac
done
cat "$OUT/steps.tsv"
exit $status
