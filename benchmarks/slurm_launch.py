"""One run started three ways on this host: ``srun`` (a real SLURM, paratrain/testing_slurm.py),
``paratrain train --workers 2`` and ``torchrun``: examples/s and the wall time of the command.
With ``--hosts``, one run over two emulated hosts (1 core and a 1 Gbit/s link each) started
three ways: ``srun -N 2`` (a slurmd on each host), ``paratrain cluster run --hosts 2`` and
torchrun on each host (``--nnodes 2``).

    sudo .venv/bin/python benchmarks/slurm_launch.py [--rounds 3] [--epochs 10] [--hosts]

Every side runs ``paratrain train --strategy allreduce`` on 2 processes over Gloo (the mlp on
digits, batch 32 per worker, the given epochs); examples/s is its metrics file's (training
steps only), the wall time the whole command's (start-up, rendezvous, training, the final
evaluation, exit). The sides take turns, in a rotated order each round; medians reported.
Writes benchmarks/results/slurm_launch.json and .md (with --hosts: slurm_launch_hosts).
Needs root and Debian's slurm-wlm and munge (scripts/install_slurm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratrain.cluster.hosts import EmulatedCluster, HostSpec  # noqa: E402
from paratrain.comm.transport import free_port  # noqa: E402
from paratrain.testing_slurm import LocalSlurm, missing  # noqa: E402

PYTHON = [sys.executable, "-m"]


def commands(epochs: int, out: Path) -> dict[str, list[str]]:
    train = [
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
        "--epochs",
        str(epochs),
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
    ]
    return {
        "srun -n 2": ["srun", "-n", "2", *PYTHON, *train],
        "paratrain train --workers 2": [*PYTHON, *train, "--workers", "2"],
        "torchrun --nproc-per-node 2": [
            *PYTHON,
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            *train,
        ],
    }


def on_hosts(epochs: int, out: Path, hosts: EmulatedCluster) -> dict[str, list[str]]:
    """The run over two emulated hosts: srun on the SLURM whose nodes they are, and
    paratrain's own launcher for emulated hosts, which makes a cluster of its own alike."""
    train = [
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
        "--epochs",
        str(epochs),
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
    ]
    rendezvous = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        hosts.hosts[0].address,
        "--master-port",
        str(free_port()),
    ]
    nodes = [
        shlex.join(
            hosts.command(host, [*PYTHON, "torch.distributed.run", *rendezvous, "--node-rank", str(i), "-m", *train])
        )
        for i, host in enumerate(hosts.hosts)
    ]
    return {
        "srun -N 2 -n 2": ["srun", "-N", "2", "-n", "2", *PYTHON, *train],
        # torchrun on each host, its hosts' interface named (their hostname is this machine's).
        "torchrun on each host": ["sh", "-c", f"export GLOO_SOCKET_IFNAME=eth0; {nodes[0]} & {nodes[1]}; wait"],
        "paratrain cluster run --hosts 2": [
            *PYTHON,
            "paratrain",
            "cluster",
            "run",
            "--hosts",
            "2",
            "--cpu",
            "1",
            "--link",
            "1gbit",
            "--",
            *PYTHON,
            *train,
        ],
    }


def measure(rounds: int, commands_of: Any, env: dict[str, str]) -> list[dict[str, dict[str, float]]]:
    """Each side once a round, in a rotated order: its examples/s and the command's wall time."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "m.json"
        names = list(commands_of(out))
        for index in range(rounds):
            result = {}
            for name in names[index % len(names) :] + names[: index % len(names)]:
                start = time.perf_counter()
                subprocess.run(commands_of(out)[name], check=True, cwd=ROOT, env=env, capture_output=True)
                wall = time.perf_counter() - start
                metrics = json.loads(out.read_text())
                assert metrics["workers"] == 2, (name, metrics["workers"])
                result[name] = {"examples_per_second": metrics["examples_per_second"], "wall_seconds": wall}
            results.append(result)
            print(json.dumps(result), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hosts", action="store_true", help="two emulated hosts, srun -N 2 against cluster run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/slurm_launch{'_hosts' if args.hosts else ''}.json"
    reason = missing()
    if reason:
        raise SystemExit(f"slurm_launch: {reason}")
    if args.hosts:
        with EmulatedCluster([HostSpec(cpu=1.0, link="1gbit"), HostSpec(cpu=1.0, link="1gbit")]) as hosts:
            slurm = LocalSlurm(hosts=hosts)
            try:
                rounds = measure(args.rounds, lambda out: on_hosts(args.epochs, out, hosts), slurm.env())
            finally:
                slurm.stop()
        base_name, where = "paratrain cluster run --hosts 2", "two emulated hosts (1 core, 1 Gbit/s each)"
    else:
        slurm = LocalSlurm()
        try:
            rounds = measure(args.rounds, lambda out: commands(args.epochs, out), slurm.env())
        finally:
            slurm.stop()
        base_name, where = "paratrain train --workers 2", "one host"
    names = list(rounds[0])
    medians = {name: {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]} for name in names}
    settings = {**vars(args), "cores": os.cpu_count()}
    Path(args.out).write_text(json.dumps({"rounds": rounds, "medians": medians, "settings": settings}, indent=1) + "\n")
    base = medians[base_name]
    table = [
        f"# allreduce, 2 processes, mlp on digits, {args.epochs} epochs, {args.rounds} rounds (medians), {where}",
        "",
        f"| launched by | examples/s | vs `{base_name}` | wall s (start to exit) |",
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
