"""The full composition matrix: every test case the suite leaves to it (marked ``matrix`` in
tests/), run with ``PARATRAIN_MATRIX=full``, and a Markdown record of each case's outcome and
time.

The suite (``bash scripts/test.sh``) runs each parallelism alone and each pair once; a case
marked ``matrix`` shows for one more strategy or layout what another case shows already (the
README script under torchrun for every strategy, both kinds of spare host, every kill drill).
Run this before a release, or after changing what those cases cover:

    .venv/bin/python benchmarks/matrix.py                # every matrix case, 3 pytest workers
    .venv/bin/python benchmarks/matrix.py --all          # the whole suite and the matrix together

It writes benchmarks/results/matrix.md and exits as pytest did.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "matrix.md"


def cases(report: Path) -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) of every case in a JUnit XML report, slowest first."""
    rows = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        rows.append((name, outcome, float(case.get("time", 0.0))))
    return sorted(rows, key=lambda row: -row[2])


def markdown(rows: list[tuple[str, str, float]], wall: float, command: list[str]) -> str:
    counts = {outcome: sum(row[1] == outcome for row in rows) for outcome in ("passed", "failed", "skipped")}
    lines = [
        "# The full composition matrix (benchmarks/matrix.py)",
        "",
        f"`{' '.join(command)}` with `PARATRAIN_MATRIX=full`, on {os.cpu_count()} cores: "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in {wall:.0f} s.",
        "",
        "| case | outcome | seconds |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| `{name}` | {outcome} | {seconds:.1f} |" for name, outcome, seconds in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="run the whole suite with the matrix, not the matrix alone")
    parser.add_argument("--workers", type=int, default=3, help="pytest-xdist workers (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "matrix.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "worksteal"]
        command += [] if args.all else ["-m", "matrix"]
        command += ["tests", f"--junitxml={report}", "-p", "no:cacheprovider"]
        start = time.monotonic()
        run = subprocess.run(command, cwd=ROOT, env={**os.environ, "PARATRAIN_MATRIX": "full"})
        wall = time.monotonic() - start
        shown = ["pytest", *command[3:-3]]
        RESULT.write_text(markdown(cases(report), wall, shown))
    print(f"matrix: {RESULT.relative_to(ROOT)}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
