"""The ``paratrain`` command line.

Exit codes: 0 done; 2 bad input (one line on stderr, no traceback); 3 the model
diverged; 1 anything else.

Every process of a run imports this module (its ``__main__`` is the ``paratrain`` script),
so simulate/, bench/ and cluster/ are imported only where the parser or a command needs them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from paratrain.comm.transport import cluster_from_env
from paratrain.console import console
from paratrain.data.datasets import load_dataset
from paratrain.errors import ConfigError, DivergedError, ParatrainError, ReplicaLeft, WorkerFailed
from paratrain.launch.env import env_command as run_env
from paratrain.launch.flags import OneLineParser, add_train_arguments, train_config
from paratrain.launch.local import run_locally
from paratrain.launch.process import start_server
from paratrain.launch.report import report
from paratrain.models import build_model
from paratrain.registry import STRATEGIES
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.ps.joining import read_run
from paratrain.train import job

EPILOG = (
    "--batch-size is per replica: the global batch is batch-size x workers. "
    "Under torchrun (or with TF_CONFIG set) the command joins that cluster instead of "
    "starting processes itself."
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="paratrain", description="Distributed training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = commands.add_parser("train", help="train a model", description="Train a model.", epilog=EPILOG)
    add_train_arguments(train)
    train.set_defaults(handler=train_command)
    simulate = commands.add_parser(
        "simulate",
        help="what-if simulation of a training cluster",
        description="Discrete-event simulation of a training cluster (docs/simulator.md).",
    )
    from paratrain.simulate.cli import add_arguments  # deferred: simulate/ off workers' start-up

    add_arguments(simulate)

    bench = commands.add_parser(
        "bench",
        help="side-by-side benchmarks: allreduce vs DDP, parameter servers, codecs, pipeline",
        description="Run benchmark suites on this machine (real multi-process runs) and write one JSON "
        "and one Markdown table; --quick for a short smoke run.",
    )
    from paratrain.bench.cli import add_arguments as add_bench_arguments  # deferred: bench/ off workers' start-up

    add_bench_arguments(bench)

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

    cluster = commands.add_parser(
        "cluster",
        help="run a job on emulated hosts (namespaces, shaped links, CPU shares)",
        description="Emulated hosts on this machine (root): network namespaces joined by a bridge, "
        "tc-shaped links, CPU cgroups; runs the command on them through torchrun (docs/cluster.md).",
    )
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, parser_class=OneLineParser)
    cluster_run = cluster_commands.add_parser("run", help="run a command on emulated hosts")
    from paratrain.cluster.run import add_arguments as add_cluster_arguments  # deferred: cluster/ off workers' start-up

    add_cluster_arguments(cluster_run)
    cluster_run.set_defaults(handler=cluster_command)
    cluster_clean = cluster_commands.add_parser(
        "clean", help="remove the hosts a killed `cluster run` left behind (namespaces, links, cgroups)"
    )
    cluster_clean.set_defaults(handler=cluster_clean_command)

    env = commands.add_parser(
        "env",
        help="PyTorch, devices, distributed backends, and a 2-process Gloo check",
        description="What this machine offers a run: PyTorch version, CUDA devices, torch.distributed backends, "
        "and whether a 2-process Gloo all-reduce on loopback works.",
    )
    env.add_argument("--no-check", action="store_true", help="skip the 2-process Gloo run")
    env.set_defaults(handler=env_command)
    return parser


def report_command(args: argparse.Namespace) -> int:
    written = report(args.runs, args.out)
    console.print(
        f"report: {len(args.runs)} run{'s' if len(args.runs) != 1 else ''}, wrote " + ", ".join(str(p) for p in written)
    )
    return 0


def cluster_command(args: argparse.Namespace) -> int:
    from paratrain.cluster.run import cluster_command as run_cluster  # deferred: cluster/ off workers' start-up

    return run_cluster(args)


def cluster_clean_command(args: argparse.Namespace) -> int:
    from paratrain.cluster.run import clean_command  # deferred: cluster/ off workers' start-up

    return clean_command(args)


def env_command(args: argparse.Namespace) -> int:
    return run_env(args)


def train_command(args: argparse.Namespace) -> int:
    if args.join:
        return join_command(args)
    cluster = cluster_from_env()
    config = train_config(args, cluster)
    topology = config.topology
    if cluster is not None:  # joined a cluster started elsewhere: this process is one rank of it
        topology.check_cluster(cluster, config.strategy)
        metrics = job.run(config)
        is_chief = "global_steps" in metrics  # the process that wrote the run's document
    else:
        if topology.num_processes > 1 or config.max_restarts:
            start_server()
            preflight(config)
        metrics = run_locally(config)
        is_chief = True
    if is_chief:
        print_summary(metrics, config.metrics_out)
    return 0


def join_command(args: argparse.Namespace) -> int:
    """One more worker for the running ps-async or ps-backup run at ``--join``: this process
    is it. It takes the run's options (the flags given here override them)."""
    if args.strategy:  # the flags given make sense on their own (--join with its mode) before any wait
        train_config(args, None)
    _, run = read_run(args.join, args.timeout or DEFAULT_TIMEOUT_S)
    if run.get("options") is None and not args.config:
        raise ConfigError(
            f"--join {args.join}: the run there publishes no options (started from Python): give --config"
        )
    config = train_config(args, None, base=run.get("options"))
    mine = job.run(config)
    console.print(
        f"done: worker {mine['rank']} took {mine['steps']} steps ({mine['examples']} examples) in the run at "
        f"{args.join}; its chief writes the run's results"
    )
    return 0


def preflight(config: Any) -> None:
    """Catch bad data, a model that does not fit it, or a model the strategy cannot run as
    configured, here, before starting N processes."""
    model = build_model(config.model, load_dataset(config).spec)
    STRATEGIES.get(config.strategy).check_model(model, config)


def print_summary(metrics: dict[str, Any], metrics_out: str | None) -> None:
    scores = [f"{key} {value:.4f}" for key, value in metrics.items() if key.startswith("test_") and value is not None]
    console.print(
        f"done: {', '.join(scores)}, "
        f"{metrics['global_steps']} steps in {metrics['wall_seconds']:.1f} s, "
        f"{metrics['examples_per_second']:.0f} examples/sec "
        f"({metrics['strategy']}, {metrics['workers']} worker{'s' if metrics['workers'] != 1 else ''})"
    )
    if metrics_out:
        console.print(f"metrics written to {metrics_out}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
