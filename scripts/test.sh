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
# Unit tests run two at a time (pytest-xdist). Distributed tests start 2-5 processes of their
# own, and some time a fault by the clock (a host killed 14 s into a run): one at a time.
# tests/conftest.py gives each xdist worker rendezvous ports of its own already; the pool of
# two waits for those faults to be placed by a run's progress instead.
.venv/bin/python -m pytest -q -n 2 tests/unit
.venv/bin/python -m pytest -q tests/smoke tests/distributed tests/examples
