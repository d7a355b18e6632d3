"""The benchmarks' own bookkeeping tests (not the product's suite, which is tests/): they import
the scripts as the scripts import each other, from benchmarks/.

    .venv/bin/python -m pytest -q benchmarks/tests
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
