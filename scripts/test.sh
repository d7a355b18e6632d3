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
# The whole suite in two pytest-xdist workers: unit tests, and distributed tests that start
# 2-5 processes of their own (tests/conftest.py gives each worker rendezvous ports of its
# own). Two, as the machine this project tests on has two cores: with four, the tests that
# time a kill or a join against a run's length lose their margins.
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal tests
