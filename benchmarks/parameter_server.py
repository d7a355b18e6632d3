"""Parameter-server training against all-reduce, and under a straggler.

What it measures, in one run, each setting a real multi-process run on this machine
(Gloo over loopback, ``paratrain.launch`` exactly as ``paratrain train`` starts it):

1. ``--workers 2,3``: training throughput (examples/s, evaluation and start-up excluded)
   of ``allreduce``, ``ps-sync``, ``ps-backup`` (one of the workers a backup) and
   ``ps-async`` for each model, and each mode's step time relative to ``allreduce``
   (step time = global batch / throughput). Target: ps-sync <= 1.3x allreduce at 2.
2. ``--straggler-workers 4``: one of 4 workers slowed ``--factor`` (2) times
   (``--straggler 3:2``); throughput of ``ps-backup`` (3 + 1 backup) and ``ps-async``
   relative to ``ps-sync``, counting every gradient computed (``all``) and only the
   applied ones (``applied``). Targets: backup >= 1.5x, async >= 1.6x.

Each setting runs ``--repeats`` times; the median is reported. The machine has 2 cores:
with more processes than cores, absolute numbers measure the scheduler as much as
paratrain; the ratios between modes run on the same machine are the result.

    .venv/bin/python benchmarks/parameter_server.py [--models mlp,cifar_cnn] [--epochs 4] [--repeats 3]

Writes benchmarks/results/parameter_server.json and .md, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.launch.torchrun import launch  # noqa: E402
from paratrain.registry import STRATEGIES  # noqa: E402
from paratrain.train import job  # noqa: E402


def run(repeats: int, **settings) -> dict:
    """Median throughput of ``repeats`` runs of one configuration."""
    config = TrainConfig(progress=False, log_every=0, device="cpu", **settings)
    strategy = STRATEGIES.get(config.strategy)
    samples = []
    for _ in range(repeats):
        results = launch(
            job.run, config,
            num_processes=strategy.num_processes(config),
            expendable=strategy.expendable_ranks(config),
        )
        metrics = results[strategy.chief_rank(config)]
        applied = sum(metrics["staleness"]["histogram"].values()) * config.batch_size
        samples.append((metrics["examples_per_second"], metrics["test_accuracy"], applied, metrics["dropped_gradients"]))
    rate = statistics.median(s[0] for s in samples)
    share_applied = statistics.median(s[2] / (s[2] + s[3] * config.batch_size) for s in samples)
    return {
        "examples_per_second": rate,
        "applied_examples_per_second": rate * share_applied,
        "test_accuracy": statistics.median(s[1] for s in samples),
        "dropped_gradients": statistics.median(s[3] for s in samples),
        "processes": strategy.num_processes(config),
    }


def modes(workers: int) -> dict[str, dict]:
    return {
        "allreduce": {"strategy": "allreduce", "workers": workers},
        "ps-sync": {"strategy": "ps-sync", "workers": workers},
        "ps-backup": {"strategy": "ps-backup", "workers": workers - 1, "backup_workers": 1},
        "ps-async": {"strategy": "ps-async", "workers": workers},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cifar_cnn")
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--straggler-workers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--out", default="benchmarks/results/parameter_server.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    scaling = []
    for model in args.models.split(","):
        for workers in map(int, args.workers.split(",")):
            base = None
            for name, settings in modes(workers).items():
                result = run(args.repeats, model=model, epochs=args.epochs, **settings)
                base = base or result["examples_per_second"]
                row = {"model": model, "workers": workers, "mode": name, **result,
                       "step_time_vs_allreduce": base / result["examples_per_second"]}
                scaling.append(row)
                print(json.dumps(row), flush=True)

    straggler = []
    n, slow = args.straggler_workers, f"{args.straggler_workers - 1}:{args.factor:g}"
    reference = None
    for name in ("ps-sync", "ps-backup", "ps-async"):
        result = run(args.repeats, model="mlp", epochs=args.epochs, straggler=slow, **modes(n)[name])
        reference = reference or result
        row = {"mode": name, **result,
               "all_vs_sync": result["examples_per_second"] / reference["examples_per_second"],
               "applied_vs_sync": result["applied_examples_per_second"] / reference["applied_examples_per_second"]}
        straggler.append(row)
        print(json.dumps(row), flush=True)

    document = {
        "scaling": scaling, "straggler": straggler,
        "settings": {**vars(args), "torch": torch.__version__, "cores": os.cpu_count(), "python": platform.python_version()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = [
        "| model | workers | mode | examples/s | step time vs allreduce | test accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {r['model']} | {r['workers']} | {r['mode']} | {r['examples_per_second']:.0f} | "
          f"{r['step_time_vs_allreduce']:.2f}x | {r['test_accuracy']:.3f} |" for r in scaling),
        "",
        f"One of {n} workers slowed {args.factor:g}x (mlp):",
        "",
        "| mode | examples/s (all) | vs ps-sync | examples/s (applied) | vs ps-sync | dropped gradients |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {r['mode']} | {r['examples_per_second']:.0f} | {r['all_vs_sync']:.2f}x | "
          f"{r['applied_examples_per_second']:.0f} | {r['applied_vs_sync']:.2f}x | {r['dropped_gradients']:.0f} |"
          for r in straggler),
    ]
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
