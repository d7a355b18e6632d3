"""``paratrain report RUN.json [RUN2.json ...] --out DIR``: plots and a table from metrics files.

Writes into DIR (PNG, matplotlib's Agg backend, no display needed):

- ``accuracy.png``: test accuracy per epoch against wall time and against examples seen,
  one line per run (from each file's ``history``);
- ``loss.png``: test loss, the same two views;
- ``throughput.png``: examples/s per run (bar), labelled by strategy;
- ``staleness.png``: histogram of gradient staleness per run (grouped bars);
- ``bytes_per_step.png``: bytes sent per global step per run (bar);
- ``report.md``: one Markdown table comparing the runs, linking the plots.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

PLOTS = ("accuracy.png", "loss.png", "throughput.png", "staleness.png", "bytes_per_step.png")
_NEEDED = (
    "strategy",
    "workers",
    "test_accuracy",
    "examples_per_second",
    "bytes_sent",
    "global_steps",
    "staleness",
    "history",
    "wall_seconds",
)


def load_run(path: str) -> dict[str, Any]:
    """A metrics file's document; ConfigError (one line) when it is missing or not one."""
    try:
        document = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; give a metrics file (paratrain train --metrics-out)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read ({getattr(error, 'strerror', None) or error})") from None
    except json.JSONDecodeError:
        raise ConfigError(f"{path}: not JSON; give a metrics file (paratrain train --metrics-out)") from None
    if not isinstance(document, dict) or any(key not in document for key in _NEEDED):
        missing = [k for k in _NEEDED if not isinstance(document, dict) or k not in document]
        raise ConfigError(f"{path}: not a paratrain metrics file (lacks {', '.join(missing)})")
    document["_label"] = label(document, path)
    return document


def label(document: dict[str, Any], path: str) -> str:
    return f"{document['strategy']} x{document['workers']} ({Path(path).stem})"


def _check_out(out: str) -> Path:
    folder = Path(out).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out {out} is a file; give a folder") from None
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot create ({error.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--out {out}: folder is not writable")
    return folder


def report(paths: list[str], out: str) -> list[Path]:
    """Load every run, write the plots and report.md into ``out``; the files written."""
    runs = [load_run(path) for path in paths]
    folder = _check_out(out)
    import matplotlib

    matplotlib.use("Agg")
    written = [
        _curves(runs, "test_accuracy", "test accuracy", folder / "accuracy.png"),
        _curves(runs, "test_loss", "test loss", folder / "loss.png"),
        _bars(
            runs, lambda r: r["examples_per_second"], "examples / s", "throughput per run", folder / "throughput.png"
        ),
        _staleness(runs, folder / "staleness.png"),
        _bars(runs, _bytes_per_step, "bytes sent / step", "communication per step", folder / "bytes_per_step.png"),
    ]
    table = folder / "report.md"
    table.write_text(markdown(runs))
    return written + [table]


def _bytes_per_step(run: dict[str, Any]) -> float:
    return run["bytes_sent"] / max(run["global_steps"], 1)


def _examples_seen(run: dict[str, Any], entry: dict[str, Any]) -> float:
    if entry.get("examples_seen") is not None:
        return entry["examples_seen"]
    # Files written before history kept examples_seen: assume equal epochs.
    total = run["examples_per_second"] * run["wall_seconds"]
    return total * entry["epoch"] / max(run.get("epochs", len(run["history"])), 1)


def _curves(runs: list[dict[str, Any]], key: str, name: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, (by_time, by_examples) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for run in runs:
        points = [e for e in run["history"] if e.get(key) is not None]
        values = [e[key] for e in points]
        by_time.plot([e["wall_seconds"] for e in points], values, marker="o", label=run["_label"])
        by_examples.plot([_examples_seen(run, e) for e in points], values, marker="o", label=run["_label"])
    by_time.set_xlabel("wall time (s)")
    by_examples.set_xlabel("training examples seen")
    for axes in (by_time, by_examples):
        axes.set_ylabel(name)
        axes.grid(alpha=0.3)
    by_examples.legend(fontsize="small")
    figure.suptitle(f"{name} per epoch")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _bars(runs: list[dict[str, Any]], value: Any, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    labels = [run["_label"] for run in runs]
    heights = [value(run) for run in runs]
    bars = axes.bar(range(len(runs)), heights, color=[f"C{i}" for i in range(len(runs))])
    axes.bar_label(bars, fmt="%.0f", fontsize="small")
    axes.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize="small")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _staleness(runs: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    histograms = [{int(k): v for k, v in (run["staleness"].get("histogram") or {}).items()} for run in runs]
    values = sorted({s for h in histograms for s in h}) or [0]
    width = 0.8 / max(len(runs), 1)
    for i, (run, histogram) in enumerate(zip(runs, histograms)):
        total = sum(histogram.values()) or 1
        axes.bar(
            [v + (i - (len(runs) - 1) / 2) * width for v in values],
            [histogram.get(v, 0) / total for v in values],
            width=width,
            label=run["_label"],
        )
    axes.set_xticks(values)
    axes.set_xlabel("staleness (versions between a gradient's parameters and its update)")
    axes.set_ylabel("share of applied gradients")
    axes.set_title("gradient staleness")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def markdown(runs: list[dict[str, Any]]) -> str:
    header = (
        "run",
        "strategy",
        "workers",
        "epochs",
        "steps",
        "test accuracy",
        "test loss",
        "wall s",
        "examples/s",
        "bytes/step",
        "staleness mean",
        "staleness max",
        "dropped",
    )
    lines = ["# paratrain report", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for run in runs:
        staleness = run["staleness"]
        cells = (
            run["_label"],
            run["strategy"],
            run["workers"],
            run.get("epochs", len(run["history"])),
            run["global_steps"],
            _num(run["test_accuracy"], 4),
            _num(run.get("test_loss"), 4),
            _num(run["wall_seconds"], 1),
            _num(run["examples_per_second"], 0),
            _num(_bytes_per_step(run), 0),
            _num(staleness.get("mean"), 2),
            staleness.get("max"),
            run.get("dropped_gradients", 0),
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", *[f"![{name[:-4]}]({name})" for name in PLOTS], ""]
    return "\n".join(lines)


def _num(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
