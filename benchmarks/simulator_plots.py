"""The figures and numbers of docs/simulator.md, from the cluster simulator.

Everything but item 4 is simulated, so it is the same on every machine for the same
seed. It runs in about 20 seconds.

1. Strategies against workers: a 100 MB model (about ResNet-50's 25 M fp32
   parameters), 100 ms of compute per step, 10 Gb/s links, 10 us latency, lognormal
   stragglers (sigma 0.3), 8 ps shards, 2 backup workers, local-sgd averaging every 8
   steps; 200 steps; workers 1..1024.
2. Ring all-reduce scaling efficiency against workers for 1, 10 and 100 Gb/s and for
   10 MB, 100 MB and 1 GB models (no stragglers).
3. Virtual-cluster training: the MLP on digits, 8 workers, lognormal stragglers (sigma
   0.5), 10 epochs, 10 ms of compute per step: test accuracy against simulated seconds
   for ps-sync, ps-backup (K=2) and ps-async with SGD momentum 0.9, and ps-async with
   momentum 0 (asynchrony adds implicit momentum, Mitliagkas et al. 2016).
4. Seconds to simulate 1024 workers x 300 steps of figure 1's cluster, per strategy
   (the only machine-dependent numbers here).

Run (from the repository root):

    .venv/bin/python benchmarks/simulator_plots.py [--out-dir docs/img] [--json benchmarks/results/simulator.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paratrain.launch.cli import build_parser  # noqa: E402
from paratrain.simulate.calibrate import model_and_data  # noqa: E402
from paratrain.simulate.cli import check_arguments, sweep  # noqa: E402

WORKERS = "1,2,4,8,16,32,64,128,256,512,1024"


def args_for(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", *flags])


def strategies_figure(path: Path) -> list[dict]:
    args = args_for(
        "--strategy",
        "allreduce,ps-sync,ps-backup,ps-async,local-sgd",
        "--workers",
        WORKERS,
        "--compute-ms",
        "100",
        "--model-mb",
        "100",
        "--straggler",
        "lognormal:0.3",
        "--ps-shards",
        "8",
        "--backup-workers",
        "2",
        "--steps",
        "200",
    )
    strategies, workers = check_arguments(args)
    rows = sweep(args, strategies, workers, None, 0.1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in strategies:
        mine = [r for r in rows if r["strategy"] == strategy]
        left.plot(workers, [r["examples_per_second"] for r in mine], marker="o", label=strategy)
        right.plot(workers, [r["scaling_efficiency"] for r in mine], marker="o", label=strategy)
    for ax, label in ((left, "examples/s (batch 32 per worker)"), (right, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=8)
    fig.suptitle("100 MB model, 100 ms/step, 10 Gb/s, lognormal(0.3) stragglers, 8 ps shards")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return rows


def bandwidth_figure(path: Path) -> list[dict]:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for ax, what, cases in (
        (
            left,
            "bandwidth (100 MB model)",
            [("1 Gb/s", "1", "100"), ("10 Gb/s", "10", "100"), ("100 Gb/s", "100", "100")],
        ),
        (right, "model size (10 Gb/s)", [("10 MB", "10", "10"), ("100 MB", "10", "100"), ("1 GB", "10", "1000")]),
    ):
        for label, gbps, mb in cases:
            args = args_for(
                "--workers", WORKERS, "--compute-ms", "100", "--model-mb", mb, "--bandwidth-gbps", gbps, "--steps", "50"
            )
            strategies, workers = check_arguments(args)
            mine = sweep(args, strategies, workers, None, 0.1)
            for r in mine:
                r.update(bandwidth_gbps=float(gbps), model_mb=float(mb))
            rows += mine
            ax.plot(workers, [r["scaling_efficiency"] for r in mine], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("workers")
        ax.set_ylabel("scaling efficiency")
        ax.set_title(f"ring all-reduce against {what}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return rows


def training_figure(path: Path) -> list[dict]:
    from paratrain.simulate.cli import build_cluster, options
    from paratrain.simulate.virtual import train_virtual

    fig, ax = plt.subplots(figsize=(6, 4))
    results = []
    runs = (
        ("ps-sync", []),
        ("ps-backup", ["--backup-workers", "2"]),
        ("ps-async", []),
        ("ps-async", ["--momentum", "0"]),
    )
    for strategy, extra in runs:
        args = args_for(
            "--train",
            "--strategy",
            strategy,
            "--workers",
            "8",
            "--epochs",
            "10",
            "--compute-ms",
            "10",
            "--straggler",
            "lognormal:0.5",
            *extra,
        )
        check_arguments(args)
        model, splits = model_and_data(args)
        cluster = build_cluster(args, 8, model, 0.01)
        result = train_virtual(args, strategy, cluster, model, splits, options(args))
        result["momentum"] = args.momentum
        results.append(result)
        ax.plot(
            [p["sim_seconds"] for p in result["history"]],
            [p["test_accuracy"] for p in result["history"]],
            marker="o",
            label=f"{strategy}, momentum {args.momentum:g}",
        )
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("test accuracy")
    ax.set_title("MLP on digits, 8 virtual workers, lognormal(0.5)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return results


def timings() -> dict[str, float]:
    """Seconds this machine takes to simulate 1024 workers x 300 steps (figure 1's cluster)."""
    import time

    from paratrain.simulate.cluster import Cluster, parse_straggler
    from paratrain.simulate.simulator import simulate

    out = {}
    for strategy in ("allreduce", "ps-sync", "ps-backup", "ps-async", "local-sgd"):
        cluster = Cluster(
            workers=1024, compute_s=0.1, model_bytes=100e6, ps_shards=8, straggler=parse_straggler("lognormal:0.3")
        )
        start = time.perf_counter()
        simulate(strategy, cluster, 300, backup=2)
        out[strategy] = round(time.perf_counter() - start, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(REPO / "docs" / "img"))
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "simulator.json"))
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "strategies": strategies_figure(out / "simulator_strategies.png"),
        "allreduce": bandwidth_figure(out / "simulator_allreduce.png"),
        "training": training_figure(out / "simulator_training.png"),
        "seconds_for_1024_workers_x_300_steps": timings(),
    }
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    for r in results["strategies"]:
        if r["workers"] in (1, 16, 256, 1024):
            print(
                f"{r['strategy']:10s} {r['workers']:5d} workers  {r['step_seconds'] * 1e3:9.1f} ms/step  "
                f"{r['examples_per_second']:9.0f} examples/s  efficiency {r['scaling_efficiency']:.3f}  "
                f"comm {r['comm_share']:.3f}  staleness {r['staleness']['mean']:.1f}/{r['staleness']['max']}"
            )
    for r in results["allreduce"]:
        if r["workers"] in (8, 64, 1024):
            print(
                f"allreduce {r['bandwidth_gbps']:5g} Gb/s {r['model_mb']:6g} MB {r['workers']:5d} workers  efficiency {r['scaling_efficiency']:.3f}"
            )
    print("seconds to simulate 1024 workers x 300 steps:", results["seconds_for_1024_workers_x_300_steps"])
    for r in results["training"]:
        print(
            f"{r['strategy']:10s} momentum {r['momentum']:g} test_accuracy {r['test_accuracy']:.4f} at {r['sim_seconds']:.3f} simulated s, "
            f"staleness {r['staleness']['mean']:.1f}/{r['staleness']['max']}, dropped {r['dropped_gradients']}"
        )


if __name__ == "__main__":
    main()
