"""The ``paratrain`` command line.

Exit codes: 0 done; 2 bad input (one line on stderr, no traceback); 3 the model
diverged; 1 anything else.

Each command's parser and handler live with the command (``COMMANDS``), and ``main``
imports only the one named: ``paratrain cluster ...`` starts without importing torch
(~2.5 s of CPU), and every process of a run (its ``__main__`` is the ``paratrain``
script) imports what training needs and nothing of simulate/, bench/ or cluster/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from paratrain.console import console
from paratrain.errors import DivergedError, ParatrainError, ReplicaLeft, WorkerFailed
from paratrain.launch.parser import OneLineParser
from paratrain.launch.report import report

#: Each command, and the function that adds its parser (with its handler) to the commands.
COMMANDS = {
    "train": "paratrain.launch.train_command:add_parser",
    "simulate": "paratrain.launch.cli:_add_simulate",
    "bench": "paratrain.launch.cli:_add_bench",
    "report": "paratrain.launch.cli:_add_report",
    "cluster": "paratrain.launch.cli:_add_cluster",
    "env": "paratrain.launch.cli:_add_env",
    "slurm": "paratrain.launch.slurm_script:add_parser",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser, or with ``only`` that command's alone."""
    parser = OneLineParser(prog="paratrain", description="Distributed training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, where in COMMANDS.items():
        if only is None or name == only:
            module, function = where.split(":")
            getattr(importlib.import_module(module), function)(commands)
    return parser


def _add_simulate(commands: Any) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="what-if simulation of a training cluster",
        description="Discrete-event simulation of a training cluster (docs/simulator.md).",
    )
    from paratrain.simulate.cli import add_arguments  # deferred: simulate/ only for this command

    add_arguments(simulate)


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="side-by-side benchmarks: allreduce vs DDP, parameter servers, codecs, pipeline",
        description="Run benchmark suites on this machine (real multi-process runs) and write one JSON "
        "and one Markdown table; --quick for a short smoke run.",
    )
    from paratrain.bench.cli import add_arguments  # deferred: bench/ only for this command

    add_arguments(bench)


def _add_report(commands: Any) -> None:
    report = commands.add_parser(
        "report",
        help="plots and a table from metrics files",
        description="PNG plots (accuracy and loss against time and examples, throughput, staleness, "
        "bytes per step) and a Markdown table (DIR/report.md) comparing runs.",
    )
    report.add_argument("runs", nargs="+", metavar="RUN.json", help="metrics files (paratrain train --metrics-out)")
    report.add_argument(
        "--out", required=True, metavar="DIR", help="folder for the PNGs and report.md (made if absent)"
    )
    report.set_defaults(handler=report_command)


def _add_cluster(commands: Any) -> None:
    cluster = commands.add_parser(
        "cluster",
        help="run a job on emulated hosts (namespaces, shaped links, CPU shares)",
        description="Emulated hosts on this machine (root): network namespaces joined by a bridge, "
        "tc-shaped links, CPU cgroups; runs the command on them through torchrun (docs/cluster.md).",
    )
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, parser_class=OneLineParser)
    cluster_run = cluster_commands.add_parser("run", help="run a command on emulated hosts")
    from paratrain.cluster.run import add_arguments, clean_command, cluster_command  # deferred: cluster/ only here

    add_arguments(cluster_run)
    cluster_run.set_defaults(handler=cluster_command)
    cluster_clean = cluster_commands.add_parser(
        "clean", help="remove the hosts a killed `cluster run` left behind (namespaces, links, cgroups)"
    )
    cluster_clean.set_defaults(handler=clean_command)


def _add_env(commands: Any) -> None:
    env = commands.add_parser(
        "env",
        help="PyTorch, devices, distributed backends, and a 2-process Gloo check",
        description="What this machine offers a run: PyTorch version, CUDA devices, torch.distributed backends, "
        "and whether a 2-process Gloo all-reduce on loopback works.",
    )
    env.add_argument("--no-check", action="store_true", help="skip the 2-process Gloo run")
    env.set_defaults(handler=env_command)


def report_command(args: argparse.Namespace) -> int:
    written = report(args.runs, args.out)
    console.print(
        f"report: {len(args.runs)} run{'s' if len(args.runs) != 1 else ''}, wrote " + ", ".join(str(p) for p in written)
    )
    return 0


def env_command(args: argparse.Namespace) -> int:
    from paratrain.launch.env import env_command as run_env  # deferred: torch only where a command needs it

    return run_env(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only=named).parse_args(argv)
    args.argv = argv  # the command line as given (a node's task passes it on: per_node.py)
    return report_errors(args.handler, args)


def report_errors(fn: Callable[..., Any], *args: Any, prog: str = "paratrain") -> int:
    """``fn(*args)``, turned into this command line's exit code: paratrain errors end in
    one line on stderr (2 bad input, 3 diverged), as the examples' scripts do too."""
    try:
        result = fn(*args)
        return result if isinstance(result, int) else 0
    except WorkerFailed as error:
        prefix = "error: " if error.exit_code == 2 else ""
        detail = str(error) if error.exit_code == 1 else error.message
        print(f"{prog}: {prefix}{detail}", file=sys.stderr)
        return error.exit_code
    except (DivergedError, ReplicaLeft) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return error.exit_code
    except ParatrainError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
