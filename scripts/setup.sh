#!/usr/bin/env bash
# Creates .venv and installs paratrain with its dependencies. Idempotent.
# TORCH_SPEC picks the PyTorch build; the default is the CPU build this project's
# machines install locally. GPU users: TORCH_SPEC="torch>=2.4" (or any CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TORCH_SPEC:=torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
fi
if [ ! -x .venv/bin/paratrain ] || [ ! -x .venv/bin/ruff ] || ! .venv/bin/python -c "import pytest, xdist, pytest_timeout, matplotlib, torchft, transformers, datasets" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot,ft]"
fi
