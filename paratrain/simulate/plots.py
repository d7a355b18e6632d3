"""Figures of ``paratrain simulate --plot`` (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from typing import Any

from paratrain.errors import ConfigError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'paratrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(payload: dict[str, Any], path: str, title: str | None = None) -> None:
    """Examples/s and scaling efficiency against workers, one line per strategy."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    strategies = dict.fromkeys(r["strategy"] for r in payload["results"])
    for strategy in strategies:
        rows = [r for r in payload["results"] if r["strategy"] == strategy]
        workers = [r["workers"] for r in rows]
        left.plot(workers, [r["examples_per_second"] for r in rows], marker="o", label=strategy)
        right.plot(workers, [r["scaling_efficiency"] for r in rows], marker="o", label=strategy)
    for ax, label in ((left, "examples/s"), (right, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(0, 1.05)
    right.legend()
    fig.suptitle(title or f"simulated, {payload['compute_seconds'] * 1e3:.3g} ms compute per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_training(payload: dict[str, Any], path: str) -> None:
    """Test accuracy against simulated wall time of a virtual-cluster run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    history = payload["history"]
    ax.plot(
        [p["sim_seconds"] for p in history],
        [p["test_accuracy"] for p in history],
        marker="o",
        label=f"{payload['strategy']}, {payload['workers']} workers",
    )
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("test accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
