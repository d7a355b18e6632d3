#!/usr/bin/env bash
# The test command: lint (ruff: pyflakes, pycodestyle, import order, bugbear), check the
# formatting, then run the test suite. Extra arguments go to one pytest run as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
# Unit tests run in one process each: two at a time (pytest-xdist). Distributed tests start
# 2-5 processes of their own and time heartbeats and timeouts: one at a time.
.venv/bin/python -m pytest -q -n 2 tests/unit
.venv/bin/python -m pytest -q tests/distributed tests/examples
