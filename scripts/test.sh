#!/usr/bin/env bash
# The test command: lint (ruff: pyflakes, pycodestyle, import order, bugbear), check the
# formatting, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
