"""Embedding tables on the parameter server: what holding them by rows saves.

    python benchmarks/ps_tables.py [--quick]

Every row is one `paratrain train` of the built-in DLRM on synthetic clicks (2 workers,
2 shards, batch 64 per worker, `--momentum 0 --lr 0.2`, one thread per process):

1. dense against tables: 4 tables of 100,000 rows (25.6 MB of rows) under ps-sync, once with
   the tables dense on the shards (every step pulls and pushes all of them) and once with
   `--tables all` (only the rows of the batch travel); ps-async and ps-backup with tables
   beside them, and ps-async with the dense layers all-reduced among the workers
   (`--dense allreduce`). Examples/s, bytes per step, test accuracy.
2. a table larger than a worker: one table of 10 million rows of 64 floats (2.56 GB) on 2
   shards: examples/s and each process's peak resident memory (`max_rss_bytes`).

Writes benchmarks/results/ps_tables.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.recorded_table import record  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "ps_tables"
COMMON = [
    "--model",
    "dlrm",
    "--workers",
    "2",
    "--ps-shards",
    "2",
    "--batch-size",
    "64",
    "--momentum",
    "0",
    "--lr",
    "0.2",
    "--threads-per-worker",
    "1",
    "--no-progress",
    "--log-every",
    "0",
]


def run(name: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ps-tables-") as tmp:
        out = Path(tmp) / "m.json"
        argv = [sys.executable, "-m", "paratrain", "train", *COMMON, *args, "--metrics-out", str(out)]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
        metrics = json.loads(out.read_text())
    tables = metrics.get("tables", {})
    rss = metrics["max_rss_bytes"]
    return {
        "name": name,
        "args": args,
        "examples_per_second": metrics["examples_per_second"],
        "bytes_per_step": metrics["bytes_per_step"],
        "test_accuracy": metrics["test_accuracy"],
        "table_bytes": sum(tables.get("bytes_per_shard", [])),
        "row_staleness_max": tables.get("row_staleness", {}).get("max"),
        "worker_max_rss": max(rss["workers"]),
        "shard_max_rss": max(rss["shards"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tables and data (a trial, written under /tmp)")
    args = parser.parse_args()
    rows, big, examples = (20_000, 1_000_000, 8_000) if args.quick else (100_000, 10_000_000, 20_000)
    data = f"clicks:rows={rows},examples={examples}"
    runs = [
        run("ps-sync, tables dense", ["--strategy", "ps-sync", "--dataset", data]),
        run("ps-sync --tables all", ["--strategy", "ps-sync", "--dataset", data, "--tables", "all"]),
        run("ps-async --tables all", ["--strategy", "ps-async", "--dataset", data, "--tables", "all"]),
        run(
            "ps-backup --tables all",
            ["--strategy", "ps-backup", "--backup-workers", "1", "--dataset", data, "--tables", "all"],
        ),
        run(
            "ps-async --tables all --dense allreduce",
            ["--strategy", "ps-async", "--dataset", data, "--tables", "all", "--dense", "allreduce"],
        ),
        run(
            f"ps-sync --tables all, 1 table of {big:,} x 64",
            [
                "--strategy",
                "ps-sync",
                "--dataset",
                f"clicks:tables=1,rows={big},examples={examples}",
                "--dlrm-dim",
                "64",
                "--tables",
                "all",
            ],
        ),
    ]
    lines = [
        "| run | examples/s | bytes per step | test accuracy | table bytes | worker peak RSS | shard peak RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['examples_per_second']:,.0f} | {r['bytes_per_step']:,.0f} | {r['test_accuracy']:.3f} "
            f"| {r['table_bytes'] / 1e6:,.0f} MB | {r['worker_max_rss'] / 1e6:,.0f} MB | {r['shard_max_rss'] / 1e6:,.0f} MB |"
        )
    out = Path("/tmp/ps_tables") if args.quick else RESULTS
    record(
        out,
        {"rows": rows, "big_rows": big, "examples": examples, "runs": runs},
        lines,
    )


if __name__ == "__main__":
    main()
