"""``paratrain simulate``: flags, validation, and the table / JSON / plot it writes.

This module imports nothing heavy at import time: launch/cli.py builds the parser from
``add_arguments`` on every ``paratrain`` call, so the engine (simulator, cluster, virtual,
plots) is imported where it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from paratrain.config import _check_writable
from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.simulate import calibration
from paratrain.simulate.flags import DEFAULT_WORKERS, add_flags, has_target
from paratrain.simulate.tables import print_candidates, print_table, print_targets, print_training


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p)
    p.set_defaults(handler=simulate_command)


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is not None and not (value >= 0 if allow_zero else value > 0):
        raise ConfigError(f"--{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    from paratrain.simulate.simulator import STRATEGIES  # deferred: kept off the parser build

    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    for s in strategies or [args.strategy]:
        if s not in STRATEGIES:
            raise ConfigError(f"--strategy must be one or more of {', '.join(STRATEGIES)}; got {s!r}")
    try:
        workers = [int(w) for w in args.workers.split(",")]
        if not workers or min(workers) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--workers must be counts >= 1, comma-separated, e.g. 1,2,4; got {args.workers!r}") from None
    for name in ("steps", "batch_size", "ps_shards", "period", "powersgd_rank", "epochs", "fragments", "fsdp_units"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("compute_ms", "model_mb", "bandwidth_gbps", "lr", "host_cores"):
        _positive(name.replace("_", "-"), getattr(args, name))
    for name in (
        "latency_us",
        "failure_rate",
        "recovery_s",
        "momentum",
        "weight_decay",
        "backup_workers",
        "max_staleness",
        "seed",
        "ps_message_us",
        "ps_update_us",
        "message_cpu_us",
        "ring_fixed_cpu_us",
        "ps_worker_cpu_us",
        "epoch_end_ms",
        "collective_us",
    ):
        _positive(name.replace("_", "-"), getattr(args, name), allow_zero=True)
    if args.host_speedup is not None:
        if args.host_cores is None:
            raise ConfigError("--host-speedup needs --host-cores (processes on one host)")
        _speedup(args.host_speedup)
    if args.cpu_share is None and (
        args.message_cpu_us
        or args.ring_fixed_cpu_us
        or args.ps_worker_cpu_us is not None
        or args.cpu_period_ms != 100.0
    ):
        raise ConfigError(
            "--message-cpu-us, --ring-fixed-cpu-us, --ps-worker-cpu-us and --cpu-period-ms need --cpu-share (nodes "
            "under a CPU quota)"
        )
    if args.ring_latency_us is not None:
        _positive("ring-latency-us", args.ring_latency_us, allow_zero=True)
    if args.staleness_bound is not None:
        _positive("staleness-bound", args.staleness_bound, allow_zero=True)
    if "ps-backup" in strategies and args.backup_workers < 1:
        raise ConfigError("--strategy ps-backup needs --backup-workers K >= 1 (K = 0 is ps-sync)")
    if args.period % args.fragments:
        raise ConfigError(f"--fragments {args.fragments} must divide --sync-every {args.period}")
    if "fsdp" in strategies and args.compression not in ("none", "fp16", "bf16"):
        raise ConfigError(f"--compression {args.compression}: fsdp reduce-scatters gradients in none, fp16 or bf16")
    targeted = has_target(args)
    if args.target_accuracy is not None and args.target_loss is not None:
        raise ConfigError("--target-accuracy and --target-loss: give one target")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        raise ConfigError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")
    _positive("target-loss", args.target_loss)
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if (args.optimizer != "sgd" or args.weight_decay) and not (
        args.train or targeted or args.calibrate or args.calibration
    ):
        raise ConfigError(
            "--optimizer and --weight-decay are for the training a prediction replays (--train, --target-*) and "
            "the update a calibration measures (--calibrate, --calibration); this prediction has neither"
        )
    if (args.train or targeted) and "diloco" in strategies:
        raise ConfigError("--train replays plain gradient steps; diloco's outer optimizer is not modelled there")
    cluster_flags = args.hosts is not None or args.link is not None or args.host or args.cpu != 1.0
    if args.recommend and (args.hosts is None or args.workers != DEFAULT_WORKERS or args.strategy != "allreduce"):
        raise ConfigError(
            "--recommend chooses the strategies and their workers on the hosts it is given: give --hosts N "
            "(and --cpu, --link, --host), not --strategy or --workers"
        )
    if cluster_flags and not args.recommend:
        raise ConfigError("--hosts, --cpu, --link and --host describe the cluster for --recommend; give it too")
    if targeted and not args.recommend and len(workers) != 1:
        raise ConfigError("--target-* compares the strategies at one --workers count, e.g. --workers 8")
    if args.train and not targeted and (len(strategies) != 1 or len(workers) != 1):
        raise ConfigError("--train takes one --strategy and one --workers count, e.g. --strategy ps-async --workers 8")
    _check_meshes(args, strategies, targeted)
    if args.calibrate and args.calibration:
        raise ConfigError("--calibrate FILE measures and predicts with FILE; --calibration reads one: give one")
    if args.calibrate_rounds is not None and not args.calibrate:
        raise ConfigError("--calibrate-rounds is how many rounds --calibrate FILE measures; give --calibrate FILE too")
    if args.calibrate_rounds is None:
        args.calibrate_rounds = 3
    if args.calibrate_rounds < 1:
        raise ConfigError(f"--calibrate-rounds must be a whole number of at least 1, got {args.calibrate_rounds}")
    if args.across_hosts and not args.calibrate:
        raise ConfigError("--across-hosts is how --calibrate FILE measures messages; give --calibrate FILE too")
    if args.across_hosts:
        from paratrain.cluster.hosts import check_support  # deferred: the emulated hosts' module

        check_support()
    if args.calibrate and args.model_mb is not None:
        raise ConfigError("--calibrate measures --model's own gradient; --model-mb is for a prediction without one")
    for name in ("json_out", "plot", "calibrate"):
        if getattr(args, name):
            _check_writable(name, getattr(args, name))
    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise ConfigError(f"--plot must name a .png, .svg or .pdf file; got {args.plot!r}")
    return strategies, workers


def _check_meshes(args: argparse.Namespace, strategies: list[str], targeted: bool) -> None:
    """The mesh flags go with the strategies that take them (tensor, pipeline), and those
    with a model to measure."""
    meshed = [s for s in ("tensor", "pipeline") if s in strategies]
    for flags, takers in (
        (
            (("--shard-replicas", args.shard_replicas, False), ("--no-loss-parallel", args.loss_parallel, True)),
            ("tensor",),
        ),
        (
            (
                ("--tensor-parallel", args.tensor_parallel, None),
                ("--tp-bandwidth-gbps", args.tp_bandwidth_gbps, None),
                ("--tp-latency-us", args.tp_latency_us, None),
                ("--tp-module-us", args.tp_module_us, None),
                ("--tp-plan", args.tp_plan, None),
            ),
            ("tensor", "pipeline"),
        ),
        (
            (
                ("--stages", args.stages, None),
                ("--microbatches", args.microbatches, None),
                ("--split-points", args.split_points, None),
            ),
            ("pipeline",),
        ),
    ):
        given = [flag for flag, value, default in flags if value != default]
        if given and not any(s in strategies for s in takers):
            raise ConfigError(
                f"{', '.join(given)} describe the meshes of --strategy {' or '.join(takers)}; "
                f"add {' or '.join(takers)} to --strategy"
            )
    if not meshed:
        return
    from paratrain.simulate.tensor_shape import counts  # deferred: imports torch

    if args.tensor_parallel is not None:
        counts(args.tensor_parallel, "--tensor-parallel")
    if args.stages is not None:
        counts(args.stages, "--stages")
    if args.microbatches is not None and args.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {args.microbatches}")
    _positive("tp-bandwidth-gbps", args.tp_bandwidth_gbps)
    _positive("tp-latency-us", args.tp_latency_us, allow_zero=True)
    _positive("tp-module-us", args.tp_module_us, allow_zero=True)
    if args.model_mb is not None:
        raise ConfigError(f"--strategy {meshed[0]} measures --model's parts and activations; --model-mb gives neither")
    if args.train or targeted or args.recommend:
        raise ConfigError(
            f"--strategy {meshed[0]} makes allreduce's updates with one replica per mesh; --train, --target-* and "
            "--recommend replay the other strategies: ask them of allreduce at that many workers"
        )


def _speedup(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--host-speedup must be numbers, comma-separated, e.g. 1,1.6,1.5; got {text!r}") from None


def build_cluster(args: argparse.Namespace, workers: int, model: Any | None, compute_s: float):
    from paratrain.simulate.cluster import Cluster, make_codec, parse_straggler  # deferred: kept off the parser build

    if args.model_mb is not None:
        model_bytes = args.model_mb * 1e6
        side = int(math.sqrt(model_bytes / 4))
        shapes = [(side, side)]
    else:
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        model_bytes = 4.0 * sum(math.prod(s) for s in shapes)
    codec = make_codec(args.compression, shapes, args.topk_ratio, args.powersgd_rank)
    if getattr(args, "codec_gbps", None):  # measured by a calibration
        codec = dataclasses.replace(codec, throughput=args.codec_gbps * 1e9)
    return Cluster(
        workers=workers,
        compute_s=compute_s,
        model_bytes=model_bytes,
        bandwidth=args.bandwidth_gbps * 1e9 / 8,
        latency=args.latency_us * 1e-6,
        ps_shards=args.ps_shards,
        ring_latency=None if args.ring_latency_us is None else args.ring_latency_us * 1e-6,
        codec=codec,
        straggler=parse_straggler(args.straggler),
        failure_rate=args.failure_rate,
        recovery_s=args.recovery_s,
        ps_message_s=(args.ps_message_us or 0.0) * 1e-6,
        ps_update_s=(args.ps_update_us or 0.0) * 1e-6,
        host_cores=args.host_cores,
        host_speedup=_speedup(args.host_speedup),
        cpu_share=args.cpu_share,
        cpu_period_s=args.cpu_period_ms * 1e-3,
        message_cpu_s=(args.message_cpu_us or 0.0) * 1e-6,
        ring_fixed_cpu_s=(args.ring_fixed_cpu_us or 0.0) * 1e-6,
        ps_worker_cpu_s=None if args.ps_worker_cpu_us is None else args.ps_worker_cpu_us * 1e-6,
        epoch_batches=getattr(args, "epoch_batches", 0),
        eval_s=(args.epoch_end_ms or 0.0) * 1e-3,
        collective_step_s=(args.collective_us or 0.0) * 1e-6,
    )


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backup": args.backup_workers,
        "staleness_bound": args.staleness_bound,
        "stale_policy": args.stale_policy,
        "max_staleness": args.max_staleness,
        "period": args.period,
        "fragments": args.fragments,
        "reshard": args.reshard_after_forward,
        "units": args.fsdp_units,
    }


def sweep(
    args: argparse.Namespace,
    strategies: list[str],
    workers: list[int],
    model: Any,
    compute_s: float,
    splits: Any = None,
) -> list[dict[str, Any]]:
    """Every strategy at every worker count, with scaling efficiency against one worker; with a
    calibration's rounds, the range of its examples/s over them (calibration.rounds_of)."""
    from paratrain.simulate.simulator import simulate  # deferred: kept off the parser build

    rounds = calibration.rounds_of(args)
    rows = []
    for strategy, extra in _variants(args, strategies, model, splits):
        baseline = None
        counts = [n for n in workers if "mesh" not in extra or n == 1 or n % extra["mesh"].size == 0]
        for n in sorted(set(counts) | {1}):
            cluster = build_cluster(args, n, model, compute_s)
            outcome = simulate(strategy, cluster, args.steps, seed=args.seed, **options(args), **extra)
            summary = outcome.summary(args.batch_size)
            if n == 1:
                baseline = summary["examples_per_second"]
            summary["scaling_efficiency"] = summary["examples_per_second"] / (n * baseline)
            if "mesh" in extra:
                summary["parameter_bytes_per_process"] = extra["mesh"].held_bytes(n)
            if rounds and n in counts:
                rates = [summary["examples_per_second"]]
                for measured in rounds:
                    own = build_cluster(measured, n, model, calibration.round_compute_s(measured, compute_s))
                    outcome = simulate(strategy, own, args.steps, seed=args.seed, **options(measured), **extra)
                    rates.append(outcome.summary(args.batch_size)["examples_per_second"])
                summary["examples_per_second_range"] = [min(rates), max(rates)]
            if n in counts:
                rows.append(summary)
    if not rows:
        raise ConfigError(
            f"--workers {args.workers}: none is a multiple of the processes a replica takes "
            "(--tensor-parallel, times --stages for pipeline)"
        )
    return rows


def _variants(args: argparse.Namespace, strategies: list[str], model: Any, splits: Any) -> list[tuple[str, dict]]:
    """Each strategy to sweep, with its options: ``tensor`` and ``pipeline`` once per mesh."""
    found: list[tuple[str, dict]] = []
    for strategy in strategies:
        if strategy == "tensor":
            from paratrain.simulate.tensor_shape import meshes  # deferred: imports torch

            found += [(strategy, {"mesh": mesh}) for mesh in meshes(args, model, splits)]
        elif strategy == "pipeline":
            from paratrain.simulate.pipeline_shape import pipeline_meshes  # deferred: imports torch

            found += [(strategy, {"mesh": mesh}) for mesh in pipeline_meshes(args, model, splits)]
        else:
            found.append((strategy, {}))
    return found


def simulate_command(args: argparse.Namespace) -> int:
    strategies, workers = check_arguments(args)
    if args.calibrate:
        _calibrate(args)
    if args.recommend:
        from paratrain.simulate.recommend import describe  # deferred: reads the hosts as paratrain cluster does

        describe(args)
    for line in calibration.apply(args):
        console.print(line)
    from paratrain.simulate.calibrate import model_and_data, profile_compute_s  # deferred: imports torch

    need_data = args.profile or args.train or args.compute_ms is None or {"tensor", "pipeline"} & set(strategies)
    model = splits = None
    if need_data or args.model_mb is None:
        model, splits = model_and_data(args)
    # epochs of the training split at the local batch: their ends (evaluation, collectives) cost too
    args.epoch_batches = len(splits.train) // args.batch_size if splits is not None else 0
    compute_s = (
        args.compute_ms / 1e3
        if args.compute_ms and not args.profile
        else profile_compute_s(model, splits, args.batch_size)
    )
    if args.recommend:
        from paratrain.simulate.recommend import recommend  # deferred: imports the engine

        payload = recommend(args, model, splits, compute_s, build_cluster, options)
        print_candidates(payload["candidates"])
        console.print(payload["recommendation"])
    elif has_target(args):
        payload = _to_target(args, strategies, workers[0], model, splits, compute_s)
    elif args.train:
        from paratrain.simulate.virtual import train_virtual  # deferred: kept off the parser build

        cluster = build_cluster(args, workers[0], model, compute_s)
        result = train_virtual(args, strategies[0], cluster, model, splits, options(args))
        print_training(result)
        payload: dict[str, Any] = {"compute_seconds": compute_s, **result}
    else:
        rows = sweep(args, strategies, workers, model, compute_s, splits)
        print_table(rows, compute_s)
        payload = {"compute_seconds": compute_s, "results": rows}
    payload["arguments"] = {k: v for k, v in vars(args).items() if k != "handler"}
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(payload, handle, indent=1)
    if args.plot:
        from paratrain.simulate.plots import plot_sweep, plot_training  # deferred: kept off the parser build

        (plot_training if args.train else plot_sweep)(payload, args.plot)
    return 0


def _to_target(
    args: argparse.Namespace, strategies: list[str], workers: int, model: Any, splits: Any, compute_s: float
) -> dict[str, Any]:
    """``--target-*``: the strategies ranked by simulated time to the target, and the line."""
    from paratrain.simulate.target import recommendation, time_to_target  # deferred: imports the engine

    cluster = build_cluster(args, workers, model, compute_s)
    rows = time_to_target(args, strategies, cluster, model, splits, options(args))
    print_targets(rows, args, workers)
    line = recommendation(rows, args, workers)
    console.print(line)
    return {"compute_seconds": compute_s, "workers": workers, "targets": rows, "recommendation": line}


def _calibrate(args: argparse.Namespace) -> None:
    """``--calibrate FILE``: measure, write, and predict with it."""
    from paratrain.simulate.calibrate import calibrate, model_and_data, write  # deferred: imports torch

    model, splits = model_and_data(args)
    measured = calibrate(args, model, splits)
    write(args.calibrate, measured)
    console.print(f"paratrain: calibration written to {args.calibrate}")
    args.calibration = args.calibrate
