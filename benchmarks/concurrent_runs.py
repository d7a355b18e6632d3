"""Several runs at once on one machine: what each run's default compute threads cost.

A process on the default threads takes its share of the machine's cores with every other
paratrain process listed on it, whichever run it belongs to (launch/host_share.py), and
follows it as runs start and end. This starts N runs of `paratrain train --strategy single`
at once, with the default threads and with `--threads-per-worker 1`, and reports each run's
examples/s (from the end of epoch 1) against one run alone.

    python benchmarks/concurrent_runs.py [--runs 3] [--model mlp] [--out benchmarks/results/concurrent_runs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record, steady_rate  # noqa: E402

MODELS = {
    "mlp": ["--model", "mlp", "--dataset", "digits", "--epochs", "6"],
    "cifar_cnn": ["--model", "cifar_cnn", "--dataset", "benchmarks.digits32:load", "--epochs", "2"],
}


def side_by_side(runs: int, model: str, threads: list[str], folder: Path) -> list[float]:
    """``runs`` runs started at once; each one's examples/s from the end of epoch 1."""
    outs = [folder / f"run-{i}.json" for i in range(runs)]
    started = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paratrain",
                "train",
                "--strategy",
                "single",
                *MODELS[model],
                *threads,
                "--seed",
                str(i),
                "--log-every",
                "0",
                "--no-progress",
                "--metrics-out",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, out in enumerate(outs)
    ]
    for process in started:
        _, err = process.communicate()
        if process.returncode:
            raise SystemExit(f"a run failed:\n{err[-2000:]}")
    return [steady_rate(json.loads(out.read_text())) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--out", default=str(RESULTS / "concurrent_runs"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, threads in (("default threads", []), ("--threads-per-worker 1", ["--threads-per-worker", "1"])):
            alone = side_by_side(1, args.model, threads, Path(tmp))[0]
            together = side_by_side(args.runs, args.model, threads, Path(tmp))
            rows.append({"threads": label, "alone": alone, "together": together})
            print(f"{label}: alone {alone:,.0f}; {args.runs} at once: {', '.join(f'{r:,.0f}' for r in together)}")
    lines = [
        f"# {args.runs} runs at once on one machine ({os.cpu_count()} cores): `single`, {args.model}",
        "",
        f"`python benchmarks/concurrent_runs.py --runs {args.runs} --model {args.model}`: each run's examples/s "
        "from the end of epoch 1; the runs started at once.",
        "",
        f"| threads | one run alone | each of {args.runs} at once (median, lowest-highest) | median / alone |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        median = statistics.median(r["together"])
        lines.append(
            f"| {r['threads']} | {r['alone']:,.0f} | {median:,.0f} ({min(r['together']):,.0f}-{max(r['together']):,.0f}) "
            f"| {median / r['alone']:.2f} |"
        )
    record(Path(args.out), {"runs": args.runs, "model": args.model, "cores": os.cpu_count(), "rows": rows}, lines)


if __name__ == "__main__":
    main()
