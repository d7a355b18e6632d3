#!/usr/bin/env bash
# Creates .venv and installs paratrain with its dependencies. Idempotent.
# TORCH_SPEC picks the PyTorch build; the default is the CPU build this project's
# machines install locally. GPU users: TORCH_SPEC="torch>=2.4" (or any CUDA build).
# PYTHON picks the interpreter of .venv. Without it: the distribution's CPython
# (/usr/bin/python3, 3.10 to 3.13) where there is one, else python3 on PATH. Distributions
# build CPython with profile-guided and link-time optimization; a CPython built from source
# without them (pyenv's default) spends ~30% more CPU importing torch and running the
# training loop's Python, which every process of a run and of the test suite pays.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TORCH_SPEC:=torch==2.13.0}"
supported='import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 13)'
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c "$supported" 2>/dev/null; then
        PYTHON=/usr/bin/python3
    fi
fi
if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import ensurepip" 2>/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m venv .venv
    else
        # Debian and Ubuntu leave ensurepip to the python3-venv package: pip comes from
        # python3's own pip instead (--python installs into another interpreter's environment).
        "$PYTHON" -m venv --without-pip .venv
        python3 -m pip --python .venv/bin/python install -q --disable-pip-version-check pip
    fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
fi
if [ ! -x .venv/bin/paratrain ] || [ ! -x .venv/bin/ruff ] || ! .venv/bin/python -c "import pytest, xdist, pytest_timeout, matplotlib, torchft, transformers, datasets" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot,ft]"
fi
