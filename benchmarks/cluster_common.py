"""What the emulated-cluster benchmarks share: one `paratrain cluster run` of a training
job, the rates and times read from its metrics file, and the CIFAR-shaped digits their CNN
runs learn (``--dataset benchmarks.cluster_common:digits32``).

Rates are taken from the end of the first epoch on: a host at a small CPU share takes
many seconds to import torch, and the first step of every mode waits for the slowest
host to start. Time to accuracy counts from the same point to the end of the first epoch
whose test accuracy reaches the target.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, however this module was imported
from recorded_table import small_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEEDS = 5  # draws of the hosts' quota phases per simulated setting
TIED = 0.10  # two results within this of each other count as tied


def fastest(values: dict[str, float | None], larger: bool = True) -> list[str]:
    """The names within TIED of the best value (larger or smaller is better; None: no value,
    e.g. a target never reached), in ``values``' order."""
    known = {k: v for k, v in values.items() if v is not None}
    if not known:
        return []
    if larger:
        best = max(known.values())
        return [k for k, v in known.items() if v >= best * (1 - TIED)]
    best = min(known.values())
    return [k for k, v in known.items() if v <= best * (1 + TIED)]


def cluster_train(cluster: list[str], train: list[str], out: Path, timeout: float = 1800) -> dict:
    """``paratrain cluster run CLUSTER -- paratrain train TRAIN``; its metrics, with
    ``steady_examples_per_second`` (examples in applied updates after epoch 1, per
    second), ``epoch_seconds`` (the mean epoch after the first) and ``usage`` (each host's
    CPU through the run: paratrain/cluster/usage.py)."""
    logs = out.parent / "logs"
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "cluster",
        "run",
        *cluster,
        "--logs",
        str(logs),
        "--",
        "paratrain",
        "train",
        *train,
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode or not out.exists():
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    metrics = json.loads(out.read_text())
    metrics["usage"] = json.loads((logs / "usage.json").read_text())
    out.unlink()
    first, last = metrics["history"][0], metrics["history"][-1]
    metrics["steady_examples_per_second"] = steady_rate(metrics)
    metrics["epoch_seconds"] = (last["wall_seconds"] - first["wall_seconds"]) / (len(metrics["history"]) - 1)
    return metrics


def steady_rate(metrics: dict) -> float:
    """A run's examples/s from the end of its first epoch to the end of its last (its
    metrics file's history)."""
    first, last = metrics["history"][0], metrics["history"][-1]
    return (last["examples_seen"] - first["examples_seen"]) / (last["wall_seconds"] - first["wall_seconds"])


def paratrain(*args: str) -> subprocess.CompletedProcess:
    """``paratrain ARGS`` to its end; its output, or SystemExit with its error's tail."""
    result = subprocess.run([sys.executable, "-m", "paratrain", *args], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"paratrain {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def recorded(out: str, args: object, names: tuple[str, ...]) -> dict:
    """``--resimulate``: the document recorded at ``out`` (.json), with its setup's ``names``
    put back into ``args`` (the runs are simulated as they were measured)."""
    document = json.loads(Path(out).with_suffix(".json").read_text())
    for name in names:
        setattr(args, name, document["setup"][name])
    return document


def link_bytes_per_s(link: str) -> float:
    """A ``--link`` rate (``100mbit``, ``1gbit``) in bytes per second."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if link.endswith(unit):
            return float(link.removesuffix(unit)) * scale / 8
    raise SystemExit(f"--link {link}: expected a rate in kbit, mbit or gbit")


def seconds_to(metrics: dict, target: float) -> float | None:
    """Seconds from the end of epoch 1 to the end of the first epoch at ``target`` test
    accuracy, or None if none reached it."""
    start = metrics["history"][0]["wall_seconds"]
    reached = [h for h in metrics["history"] if (h["test_accuracy"] or 0) >= target]
    return reached[0]["wall_seconds"] - start if reached else None


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the runs that reached a target, or None when most did not."""
    reached = sorted(v for v in values if v is not None)
    return statistics.median(reached) if len(reached) * 2 > len(values) else None


def shown(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "not reached"


def record(out: Path, document: dict, lines: list[str]) -> None:
    """The results as JSON and a Markdown table beside it; the table to stdout."""
    out.with_suffix(".json").write_text(small_json(document))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def simulated_on_quota_hosts(
    strategy: str, workers: int, cpu: float, compute_s: float, link: str, message_cpu_s: float, **cluster: Any
) -> dict:
    """The simulator's rate (examples/s, batch 32) and mean staleness for ``strategy`` on the
    mlp, on hosts as ``paratrain cluster run --cpu`` makes them: each at ``cpu`` of a core
    under a quota of ``cpu`` x 10 ms per 10 ms period, links of ``link``; means over
    ``SEEDS`` draws of the hosts' phases. ``cluster``: more ``Cluster`` fields (the shard's
    work, a straggler), ``backup`` the backup workers."""
    from paratrain.cluster.hosts import PERIOD_US
    from paratrain.simulate.cluster import Cluster
    from paratrain.simulate.simulator import simulate

    backup = cluster.pop("backup", 0)
    nodes = Cluster(
        workers=workers,
        compute_s=compute_s,
        model_bytes=4.0 * mlp_floats(),
        bandwidth=link_bytes_per_s(link),
        latency=0.0,  # a veth pair and a bridge: microseconds, against milliseconds of quota
        cpu_share=cpu,
        cpu_period_s=PERIOD_US * 1e-6,
        message_cpu_s=message_cpu_s,
        **cluster,
    )
    runs = [simulate(strategy, nodes, 400, seed=seed, backup=backup).summary(32) for seed in range(SEEDS)]
    return {
        "examples_per_second": statistics.mean(r["examples_per_second"] for r in runs),
        "staleness_mean": statistics.mean(r["staleness"]["mean"] for r in runs),
    }


@functools.cache
def mlp_floats() -> int:
    """The mlp's parameters on digits: what one of its all-reduces sums (built once:
    calibration simulates many times)."""
    from paratrain.data.datasets import load_digits
    from paratrain.models import build_model

    return sum(p.numel() for p in build_model("mlp", load_digits().spec).parameters())


def calibrate(rate_at: Callable[[float], float], target: float, low: float = 1e-7, high: float = 0.1) -> float:
    """The value in [low, high] at which ``rate_at`` (decreasing) gives ``target``: bisection on
    a log scale."""
    for _ in range(30):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if rate_at(middle) > target else (low, middle)
    return (low * high) ** 0.5


def digits32():
    """scikit-learn's digits at CIFAR-10's shape (3x32x32), for runs that need the tutorial
    CNN's real compute per example on data that can be learned here (no data set can be
    downloaded on the benchmark machine): each 8x8 image scaled up bilinearly and repeated
    over three channels; the built-in digits split.

        paratrain train --model cifar_cnn --dataset benchmarks.cluster_common:digits32
    """
    import torch.nn.functional as F  # torch only in the training process that loads it
    from torch.utils.data import TensorDataset

    from paratrain.data.datasets import load_digits

    def upscaled(part: TensorDataset) -> TensorDataset:
        images, labels = part.tensors
        large = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
        return TensorDataset(large.expand(-1, 3, -1, -1).contiguous(), labels)

    splits = load_digits()
    return upscaled(splits.train), upscaled(splits.test)
