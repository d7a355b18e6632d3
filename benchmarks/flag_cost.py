"""What a flag costs a run's speed: named variants of one ``paratrain train`` command, run
in turns, each as steps per second of training.

    python benchmarks/flag_cost.py --flags "--strategy local-sgd --workers 2 --sync-every 8" \\
        --variant "step log every 50=--log-every 50" --variant "step log every step=--log-every 1" \\
        [--model cifar_cnn] [--epochs 16] [--repeats 3] --out benchmarks/results/NAME

``--flags`` go to every run, each ``--variant NAME=FLAGS`` adds its own (``{dir}`` in them
is a fresh folder of the run: ``--checkpoint-dir {dir}/ckpt``). Each repeat runs every
variant once, in an order that turns by one each repeat (so that no variant always runs
first on a machine whose speed drifts); a row is the median over the repeats, with their
lowest and highest. Steps per second are the run's steps over its epochs' training time
(what happens during the epochs included: step logs, saves; evaluation and the start not);
a run's seconds are its whole command's. The models are ``checkpoint_async.py``'s (cifar_cnn:
digits at 3x32x32 with Adam, as in ``ft_recovery.py``). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_async import MODELS, spread  # noqa: E402
from cluster_common import record  # noqa: E402
from processor import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=FLAGS")
    return name.strip(), flags.strip()


def run(args: argparse.Namespace, flags: str, folder: Path) -> dict:
    """One ``paratrain train`` with ``flags`` added: its steps/s over training time and its seconds."""
    out = folder / "m.json"
    extra = shlex.split(args.flags) + shlex.split(flags.replace("{dir}", str(folder)))
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        *MODELS[args.model],
        "--epochs",
        str(args.epochs),
        "--no-progress",
        "--metrics-out",
        str(out),
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    seconds = time.perf_counter() - start
    metrics = json.loads(out.read_text())
    train = sum(entry["train_seconds"] for entry in metrics["history"])
    return {"steps_per_second": metrics["global_steps"] / train, "seconds": seconds, "steps": metrics["global_steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="flags of every run (the strategy, its workers)")
    parser.add_argument("--variant", type=variant, action="append", required=True, help="NAME=FLAGS, two or more")
    parser.add_argument("--model", default="cifar_cnn", choices=tuple(MODELS))
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants = dict(args.variant)
    if len(variants) < 2:
        parser.error("--variant: two or more, with different names")
    names = list(variants)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            with tempfile.TemporaryDirectory(prefix="paratrain-flag-cost-") as folder:
                runs[name].append(run(args, variants[name], Path(folder)))
            print(f"repeat {repeat + 1}, {name}: {runs[name][-1]['steps_per_second']:.2f} steps/s", flush=True)
    first = statistics.median(r["steps_per_second"] for r in runs[names[0]])
    lines = [
        f"# What flags cost: {args.model}, `{args.flags}`, {args.epochs} epochs",
        "",
        f"| variant | its flags | steps/s | of `{names[0]}` | the run's seconds |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name in names:
        rates = [r["steps_per_second"] for r in runs[name]]
        lines.append(
            f"| {name} | `{variants[name]}` | {spread(rates, 2)} | {statistics.median(rates) / first:.0%} "
            f"| {spread([r['seconds'] for r in runs[name]], 1)} |"
        )
    lines += [
        "",
        f"Medians of {args.repeats} runs of each (lowest and highest in brackets), the variants taking "
        f"turns. Steps/s: the run's steps over its epochs' training time. Processor: {cpu_name()}.",
    ]
    record(Path(args.out), {"setup": {**vars(args), "variant": variants, "processor": cpu_name()}, "runs": runs}, lines)


if __name__ == "__main__":
    main()
