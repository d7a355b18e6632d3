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
# The whole suite: every test under tests/, in one pool of three pytest-xdist workers on the
# 2 cores (a distributed test spends much of its time waiting on its processes' start-up or a
# peer, and another test's work fills those waits). tests/distributed comes first in the
# collection, so the short unit tests fill the end; --dist worksteal keeps every worker busy to
# the last test. The cases marked `matrix` repeat what another case shows for one more strategy
# or layout: the suite leaves them to benchmarks/matrix.py (tests/conftest.py). tests/gpu runs
# where a GPU is visible and is skipped elsewhere (docs/gpu.md).
exec .venv/bin/python -m pytest -q -n 3 --dist worksteal tests
