#!/usr/bin/env bash
# The checks that need a machine with a CUDA GPU (and its 16 cores), each step bounded by
# its own timeout so that one that hangs loses only itself. The default pass (the GPU tests,
# the GPU benchmark, the straggler runs) fits in about 6 minutes; the whole suite with CUDA
# visible is a pass of its own (ONLY=suite: about 1,340 tests, past 280 s at -n 14 on an
# H200's 16 cores). Run from the repository root on that machine; results go to $OUT (default
# /tmp/gpu-check) as gpu-check.tar.gz, which holds:
#   env.txt          the GPU, driver, Python and torch
#   gpu_tests.log    tests/gpu (every strategy on CUDA against the CPU reference)
#   gpu.json/.md     benchmarks/gpu.py (single against a plain loop; throughput per strategy)
#   parameter_server.json/.md, simulate.json
#                    a straggler among 8 workers under ps-sync, ps-backup and ps-async on
#                    the CPU cores, and the simulator's prediction of the same runs
#   tests.log        the tests named in TESTS (step "tests")
#   profile-*.txt    with BENCH_ARGS=--profile: each side's kernels, GPU time and host profile
#   suite.log        the whole suite with CUDA visible
# Python packages the machine lacks (torchft, datasets) are installed from wheels in .whl/
# when that folder exists (pip download them beside the repository first).
# Without datasets, tests/distributed/test_transformers.py is skipped, and with it every
# module that takes its helpers (tensor parallelism and pipelines of a GPT-2): a node id of
# one of those in TESTS then makes pytest collect nothing ("found no collectors").
set -u
OUT=${OUT:-/tmp/gpu-check}
RESULTS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="$PATH:/tmp/site/bin"
fi
ONLY=${ONLY:-gpu-tests gpu-bench straggler simulate}  # the steps to run (and: suite, tests)
# TESTS: test paths for the step "tests", run on cores 6-15 beside the GPU benchmark
# BENCH_ARGS: options for benchmarks/gpu.py (default --profile; e.g. "--rounds 9 --parts overhead")
step() {  # step NAME SECONDS COMMAND...: run with a deadline, log its time and exit code
    local name=$1 seconds=$2 begin=$SECONDS
    shift 2
    [[ " $ONLY " == *" $name "* ]] || return 0
    timeout -k 10 "$seconds" "$@"
    echo "$name: exit $? after $((SECONDS - begin)) s" | tee -a "$RESULTS/steps.txt"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
    nproc
} >"$RESULTS/env.txt" 2>&1

step gpu-tests "${GPU_TESTS_S:-130}" $PY -m pytest tests/gpu -n 8 -v --tb=short -p no:cacheprovider --timeout 120 \
    >"$RESULTS/gpu_tests.log" 2>&1

# The GPU benchmark on six cores, beside the CPU-only straggler runs on the other ten.
step gpu-bench "${BENCH_S:-210}" taskset -c 0-5 $PY benchmarks/gpu.py ${BENCH_ARGS:---profile} --out "$RESULTS" >"$RESULTS/gpu_bench.log" 2>&1 &
(
    export OMP_NUM_THREADS=1
    step tests "${TESTS_S:-240}" taskset -c 6-15 $PY -m pytest ${TESTS:-tests/gpu} -n 8 -v --tb=short \
        -p no:cacheprovider --timeout 150 >"$RESULTS/tests.log" 2>&1
    step straggler "${STRAGGLER_S:-180}" taskset -c 6-15 $PY benchmarks/parameter_server.py --models mlp \
        --workers 8 --straggler-workers 8 --factor 4 --epochs 20 --repeats 1 \
        --out "$RESULTS/parameter_server.json" >"$RESULTS/straggler.log" 2>&1
    step simulate 60 taskset -c 6-15 $PY -m paratrain simulate --strategy ps-sync,ps-backup,ps-async --workers 8 \
        --backup-workers 1 --straggler fixed:7:4 --profile --host-cores 10 --json-out "$RESULTS/simulate.json" \
        >>"$RESULTS/straggler.log" 2>&1
) &
wait

step suite "${SUITE_S:-480}" $PY -m pytest -n 14 -v --tb=short -p no:cacheprovider --timeout 100 \
    tests/gpu tests/distributed tests/examples tests/unit >"$RESULTS/suite.log" 2>&1
cat "$RESULTS/steps.txt"
tar -czf "$OUT/gpu-check.tar.gz" -C "$RESULTS" . && rm -rf "$RESULTS"
