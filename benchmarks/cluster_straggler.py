"""A slow machine among the workers, on emulated hosts: ps-sync, ps-backup and ps-async.

Host 0 holds the parameter-server shard; hosts 1..4 the four workers, each with the same
CPU share except the last, which has half of it: a machine that computes at half speed,
not a sleeping process that hands its core to the others. Runs `paratrain cluster run`
(root) for each mode, in interleaved rounds, and records the applied examples/s (the
examples in updates the shards applied, per second of training) and the test accuracy.

    sudo .venv/bin/python benchmarks/cluster_straggler.py [--rounds 2] [--epochs 3] [--cpu 0.36]

ps-backup takes rounds of 3 of the 4 workers (`--workers 3 --backup-workers 1`, Chen et
al. 2016); ps-async applies every gradient as it arrives. Writes
benchmarks/results/cluster_straggler.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PER_UPDATE = {"ps-sync": 4, "ps-backup": 3, "ps-async": 1}  # gradients in one applied update
MODES = {
    "ps-sync": ["--strategy", "ps-sync", "--workers", "4"],
    "ps-backup": ["--strategy", "ps-backup", "--workers", "3", "--backup-workers", "1"],
    "ps-async": ["--strategy", "ps-async", "--workers", "4"],
}


def run(mode: str, args: argparse.Namespace, folder: Path) -> dict:
    out = folder / f"{mode}.json"
    command = [
        sys.executable, "-m", "paratrain", "cluster", "run", "--hosts", "5", "--cpu", str(args.cpu),
        "--host", f"4:cpu={args.cpu * args.slow:g}", "--",
        "paratrain", "train", *MODES[mode], "--model", args.model, "--dataset", args.dataset,
        "--epochs", str(args.epochs), "--no-progress", "--log-every", "0", "--metrics-out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"{mode} failed:\n{result.stderr[-2000:]}\n{result.stdout[-2000:]}")
    metrics = json.loads(out.read_text())
    # examples_per_second counts every gradient computed; a dropped one was not applied
    applied = metrics["global_steps"] * PER_UPDATE[mode]
    metrics["applied_per_second"] = metrics["examples_per_second"] * applied / (applied + metrics["dropped_gradients"])
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cpu", type=float, default=0.36, help="each host's share (5 hosts on this machine)")
    parser.add_argument("--slow", type=float, default=0.5, help="the slow host's share, relative to the others")
    parser.add_argument("--model", default="cifar_cnn")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--out", default=str(RESULTS / "cluster_straggler"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in MODES:
                metrics = run(mode, args, Path(tmp))
                runs[mode].append(metrics)
                print(f"round {round_ + 1} {mode:9} {metrics['applied_per_second']:8.0f} applied examples/s "
                      f"accuracy {metrics['test_accuracy']:.3f} dropped {metrics['dropped_gradients']}", flush=True)  # fmt: skip
    base = statistics.median(m["applied_per_second"] for m in runs["ps-sync"])
    rows = []
    for mode, metrics in runs.items():
        speed = statistics.median(m["applied_per_second"] for m in metrics)
        rows.append({
            "mode": mode,
            "examples_per_second": speed,
            "vs_ps_sync": speed / base,
            "test_accuracy": statistics.median(m["test_accuracy"] for m in metrics),
            "dropped_gradients": statistics.median(m["dropped_gradients"] for m in metrics),
            "runs": [m["applied_per_second"] for m in metrics],
        })  # fmt: skip
    setup = {key: getattr(args, key) for key in ("rounds", "epochs", "cpu", "slow", "model", "dataset")}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# One slow host of four workers: {args.model} on {args.dataset}, emulated hosts",
        "",
        f"5 hosts (1 shard, 4 workers), each {args.cpu:g} of a core; the last worker's host "
        f"{args.cpu * args.slow:g}. Median of {args.rounds} interleaved rounds of {args.epochs} epochs "
        "(`sudo python benchmarks/cluster_straggler.py`).",
        "",
        "| mode | applied examples/s | vs ps-sync | test accuracy | dropped gradients | runs |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['examples_per_second']:.0f} | {r['vs_ps_sync']:.2f}x | {r['test_accuracy']:.3f} "
            f"| {r['dropped_gradients']:.0f} | {', '.join(f'{v:.0f}' for v in r['runs'])} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
