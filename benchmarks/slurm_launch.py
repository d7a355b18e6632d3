"""One run started three ways on this host: ``srun`` (a real SLURM, paratrain/testing_slurm.py),
``paratrain train --workers 2`` and ``torchrun``: examples/s and the wall time of the command.

    sudo .venv/bin/python benchmarks/slurm_launch.py [--rounds 3] [--epochs 10]

Every side runs ``paratrain train --strategy allreduce`` on 2 processes over Gloo (the mlp on
digits, batch 32 per worker, the given epochs); examples/s is its metrics file's (training
steps only), the wall time the whole command's (start-up, rendezvous, training, the final
evaluation, exit). The sides take turns, in a rotated order each round; medians reported.
Writes benchmarks/results/slurm_launch.json and .md. Needs root and Debian's slurm-wlm and
munge (scripts/install_slurm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratrain.comm.transport import free_port  # noqa: E402
from paratrain.testing_slurm import LocalSlurm, missing  # noqa: E402

PYTHON = [sys.executable, "-m"]


def commands(epochs: int, out: Path) -> dict[str, list[str]]:
    train = ["paratrain", "train", "--strategy", "allreduce", "--epochs", str(epochs), "--no-progress",
             "--log-every", "0", "--metrics-out", str(out)]  # fmt: skip
    return {
        "srun -n 2": ["srun", "-n", "2", *PYTHON, *train],
        "paratrain train --workers 2": [*PYTHON, *train, "--workers", "2"],
        "torchrun --nproc-per-node 2": [*PYTHON, "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                                        "127.0.0.1", "--master-port", str(free_port()), "-m", *train],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/slurm_launch.json")
    args = parser.parse_args()
    reason = missing()
    if reason:
        raise SystemExit(f"slurm_launch: {reason}")
    slurm = LocalSlurm()
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "m.json"
            names = list(commands(args.epochs, out))
            for index in range(args.rounds):
                result = {}
                for name in names[index % len(names) :] + names[: index % len(names)]:
                    start = time.perf_counter()
                    subprocess.run(commands(args.epochs, out)[name], check=True, cwd=ROOT, env=slurm.env(),
                                   capture_output=True)  # fmt: skip
                    wall = time.perf_counter() - start
                    metrics = json.loads(out.read_text())
                    assert metrics["workers"] == 2, (name, metrics["workers"])
                    result[name] = {"examples_per_second": metrics["examples_per_second"], "wall_seconds": wall}
                rounds.append(result)
                print(json.dumps(result), flush=True)
    finally:
        slurm.stop()
    medians = {name: {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]} for name in names}
    settings = {**vars(args), "cores": os.cpu_count()}
    Path(args.out).write_text(json.dumps({"rounds": rounds, "medians": medians, "settings": settings}, indent=1) + "\n")
    base = medians["paratrain train --workers 2"]
    table = [
        f"# allreduce, 2 processes, mlp on digits, {args.epochs} epochs, {args.rounds} rounds (medians), one host",
        "",
        "| launched by | examples/s | vs paratrain's launcher | wall s (start to exit) |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| `{name}` | {m['examples_per_second']:.0f} | {m['examples_per_second'] / base['examples_per_second']:.2f}x "
            f"| {m['wall_seconds']:.1f} |"
            for name, m in medians.items()
        ),
    ]
    Path(args.out).with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
