#!/usr/bin/env bash
# The test command: lint (ruff: pyflakes, pycodestyle, import order, bugbear), check the
# formatting, then run the test suite. Extra arguments go to one pytest run as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ] && [ "$1" != "--quick" ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
# --quick: the unit tests that take under a few seconds and one short run of each strategy
# (tests/smoke), for the edit-test loop; the whole suite before a commit.
if [ "${1:-}" = "--quick" ]; then
    exec .venv/bin/python -m pytest -q -n 2 -m "not slow" tests/unit tests/smoke
fi
# The whole suite in one pool of three pytest-xdist workers: a distributed test spends much
# of its time waiting (on its processes' start-up, a timeout it checks, a peer), and another
# test's work fills those waits: with three, the 2 cores are 97-99% busy over the run (from
# /proc/stat), so the suite's time is its CPU time; four made every test slower and the
# suite 40 s longer. About half of that CPU starts Python processes (torch and, at a first
# optimizer step, torch._dynamo: ~5 s each), which is why scripts/setup.sh prefers the
# distribution's optimized CPython. The distributed tests go first, so that the short unit tests
# fill the end, and a worker that runs out of tests takes queued ones from the others
# (--dist worksteal), so that no worker ends minutes after the rest. tests/conftest.py gives
# each worker rendezvous ports of its own and runs `paratrain` commands in the worker itself
# (one fork server a worker, not one a command); faults are placed by a run's progress, not the clock, so load does not move them.
# tests/smoke is left out: each strategy's one short run there is checked more strictly here.
# tests/gpu runs where a GPU is visible and is skipped elsewhere (docs/gpu.md).
exec .venv/bin/python -m pytest -q -n 3 --dist worksteal tests/distributed tests/examples tests/unit tests/gpu
