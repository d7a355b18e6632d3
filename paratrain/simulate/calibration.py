"""Predictions from a calibration file (``--calibration FILE``, written by ``--calibrate``,
calibrate.py): the costs a flag does not give are taken from it, and one line before the
table says where each number came from. A prediction without a calibration says so."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

FORMAT = "paratrain-calibration"
VERSION = 1

#: Each cost a calibration holds, and how a line names it.
COSTS = {
    "compute_ms": "compute {:.3g} ms a step",
    "ring_step_us": "a ring step {:.3g} us",
    "message_cpu_us": "{:.3g} us of CPU a message received",
    "ps_push_us": "a push and its reply {:.3g} us",
    "ps_update_us": "a shard's update {:.3g} us",
    "codec_gbps": "its codec {:.3g} GB/s",
}
#: Costs a calibration may hold (older files lack them), and how a line names each.
OPTIONAL = {
    "host_link_gbps": "a host's link {:.3g} Gb/s",
    "host_step_us": "{:.3g} us a ring step on it (tensor's replicas, an epoch end's all-reduces)",
    "tp_module_us": "{:.3g} us a split module adds (tensor)",
    "epoch_end_ms": "an epoch's end {:.3g} ms",
    "host_step_cpu_us": "{:.3g} us of CPU a ring step on it",
    "shard_push_cpu_us": "{:.3g} us of a shard's CPU a push",
    "ps_worker_cpu_us": "{:.3g} us of a worker's CPU a push and its reply",
    "ring_fixed_cpu_us": "{:.3g} us of CPU a ring all-reduce's launch and finish",
}
#: The costs each round of a calibration's measuring runs gives (its ``rounds``: the spread of
#: the machine's speed while it measured; ``costs`` holds their medians). Older files have none;
#: newer rounds hold OPTIONAL costs too (a ring's fixed CPU, the host's link): where a round
#: lacks one, the file's value stands for it.
ROUND_COSTS = (
    "compute_ms",
    "ring_step_us",
    "message_cpu_us",
    "ps_push_us",
    "shard_push_cpu_us",
    "ps_worker_cpu_us",
    "epoch_end_ms",
)
#: A hypervisor's share of the CPU while a calibration measured that its line names.
STEAL_SAID = 0.01
#: What a calibration must share with the prediction that takes it, and what an older file
#: that does not say measured (version 1 files before the optimizer was recorded: SGD).
SAME = ("model", "dataset", "batch_size", "compression", "optimizer")
UNSAID = {"optimizer": "sgd"}
#: The engine's costs that are CPU under a quota and have no meaning on whole cores.
QUOTA_ONLY = ("message_cpu_us", "ring_fixed_cpu_us")


def load(path: str, named: str = "") -> dict[str, Any]:
    """The calibration in ``path``; ConfigError (one line, the file ``named`` as the flag
    that gave it) when it is none."""
    named = named or f"--calibration {path}"
    try:
        calibration = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{named}: no such file (paratrain simulate --calibrate {path} makes it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{named}: not a calibration file ({error})") from None
    if not isinstance(calibration, dict) or calibration.get("format") != FORMAT:
        raise ConfigError(f"{named}: not a paratrain calibration file")
    if calibration.get("version") != VERSION:
        raise ConfigError(
            f"{named}: version {calibration.get('version')} of the calibration file; this paratrain "
            f"reads version {VERSION}: measure again with --calibrate"
        )
    costs = calibration.get("costs")
    if not isinstance(costs, dict) or not all(_is_cost(costs.get(name)) for name in COSTS):
        raise ConfigError(f"{named}: its costs must be numbers >= 0 for {', '.join(COSTS)}")
    for name in OPTIONAL:
        if name in costs and not _is_cost(costs[name]):
            raise ConfigError(f"{named}: its {name} must be a number >= 0")
    rounds = calibration.get("rounds", [])
    if not isinstance(rounds, list) or not all(
        isinstance(r, dict) and all(_is_cost(r.get(n)) for n in ROUND_COSTS) for r in rounds
    ):
        raise ConfigError(f"{named}: its rounds must each hold numbers >= 0 for {', '.join(ROUND_COSTS)}")
    for name in OPTIONAL:
        if any(name in r and not _is_cost(r[name]) for r in rounds):
            raise ConfigError(f"{named}: its rounds' {name} must be numbers >= 0")
    return calibration


def _is_cost(value: Any) -> bool:
    """Whether a calibration file's value is a cost: a number >= 0 (NaN is not)."""
    return isinstance(value, (int, float)) and value >= 0


def load_for(path: str, args: argparse.Namespace, named: str = "") -> dict[str, Any]:
    """The calibration in ``path``, refused in one line unless it measured this prediction's
    model, data, batch, codec and optimizer."""
    named = named or f"--calibration {path}"
    calibration = load(path, named)
    model = calibration["model"]
    measured = {name: model.get(name, UNSAID.get(name)) for name in SAME}
    differ = [name for name in SAME if measured[name] != getattr(args, name)]
    if differ:
        raise ConfigError(
            f"{named} measured {', '.join(f'{n}={measured[n]}' for n in differ)}; "
            f"this prediction has {', '.join(f'{n}={getattr(args, n)}' for n in differ)}: calibrate for it"
        )
    return calibration


def _collective_us(costs: dict[str, float], quota: bool) -> float:
    """A step of an all-reduce of a few values: its CPU on nodes under a quota, its time on
    whole cores; none from a file from before epochs' ends were measured."""
    if "epoch_end_ms" not in costs:
        return 0.0
    return costs.get("host_step_cpu_us", 0.0) if quota else costs.get("host_step_us", 0.0)


def _engine(costs: dict[str, float], quota: bool) -> dict[str, tuple[str, float]]:
    """The engine's parameters from a calibration's costs, with the flag that gives each: a
    push at a shard costs its message's CPU and the reply's at the worker on quota nodes
    (--cpu-share) on top of --ps-message-us, not elsewhere. Where the file has each end's own
    CPU a push (measured in the parameter server's run), those: the shard's beyond a
    message's, and the worker's."""
    message = costs["ps_push_us"] - costs["ps_update_us"] - (2 * costs["message_cpu_us"] if quota else 0.0)
    if quota and "shard_push_cpu_us" in costs:
        message = costs["shard_push_cpu_us"] - costs["message_cpu_us"]
    engine = {
        "compute_ms": ("--compute-ms", costs["compute_ms"]),
        "ring_latency_us": ("--ring-latency-us", costs["ring_step_us"]),
        "message_cpu_us": ("--message-cpu-us", costs["message_cpu_us"]),
        # a file from before a ring's fixed CPU was measured apart: none (its messages' CPU has it)
        "ring_fixed_cpu_us": ("--ring-fixed-cpu-us", costs.get("ring_fixed_cpu_us", 0.0)),
        "ps_message_us": ("--ps-message-us", max(message, 0.0)),
        "ps_update_us": ("--ps-update-us", costs["ps_update_us"]),
        # a file from before epochs' ends were measured: none (its steps' costs include them)
        "epoch_end_ms": ("--epoch-end-ms", costs.get("epoch_end_ms", 0.0)),
        "collective_us": ("--collective-us", _collective_us(costs, quota)),
    }
    if quota and "ps_worker_cpu_us" in costs:
        engine["ps_worker_cpu_us"] = ("--ps-worker-cpu-us", costs["ps_worker_cpu_us"])
    return engine


def rounds_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The prediction's flags once for each round of its calibration's measuring runs, each
    with that round's costs where the calibration gave them (``apply`` first): the same
    prediction on the machine as each round found it. None (an empty list) for a prediction
    without a calibration, or with one of a single round or from before the rounds were kept."""
    rounds = []
    for costs in getattr(args, "calibration_rounds", []):
        engine = _engine(costs, args.cpu_share is not None)
        rounds.append(argparse.Namespace(**{**vars(args), **{n: engine[n][1] for n in args.calibrated}}))
    return rounds


def round_compute_s(measured: argparse.Namespace, compute_s: float) -> float:
    """A step's compute in seconds under one of ``rounds_of``'s flags: the round's where the
    calibration gave it, else the prediction's (``compute_s``: a flag, or --profile's)."""
    return measured.compute_ms / 1e3 if "compute_ms" in measured.calibrated else compute_s


def apply(args: argparse.Namespace) -> list[str]:
    """Fill the costs that no flag gave from ``--calibration``; the lines that say where the
    numbers came from."""
    if args.calibration is None:
        return [
            "paratrain: no calibration: a message's and a shard's CPU are taken as 0 and the codec's speed as "
            "assumed (paratrain simulate --calibrate FILE measures them here; then --calibration FILE)"
        ]
    calibration = load_for(args.calibration, args)
    model = calibration["model"]
    if args.model_mb is not None:
        raise ConfigError(
            f"--model-mb and --calibration {args.calibration}: the calibration measured {model['model']}'s "
            f"gradient ({model['gradient_bytes'] / 1e6:.3g} MB); give one or the other"
        )
    costs = calibration["costs"]
    quota = args.cpu_share is not None
    given, args.calibrated = [], []
    for name, (flag, value) in _engine(costs, quota).items():
        if name == "compute_ms" and args.profile:
            continue
        if getattr(args, name) is not None:
            given.append(flag)
        elif name not in QUOTA_ONLY or quota:
            setattr(args, name, value)
            args.calibrated.append(name)
    # each round's costs, for the prediction's range (rounds_of); one round has no range
    rounds = calibration.get("rounds", [])
    args.calibration_rounds = [{**costs, **r} for r in rounds] if len(rounds) > 1 else []
    args.codec_gbps = costs["codec_gbps"]
    for name, flag, attribute in (
        ("host_link_gbps", "--tp-bandwidth-gbps", "tp_bandwidth_gbps"),
        ("host_step_us", "--tp-latency-us", "tp_latency_us"),
        ("tp_module_us", "--tp-module-us", "tp_module_us"),
    ):
        if costs.get(name) and {"tensor", "pipeline"} & set(args.strategy.split(",")):
            if getattr(args, attribute) is None:
                setattr(args, attribute, costs[name])
            else:
                given.append(flag)
    taken = [words.format(costs[name]) for name, words in COSTS.items() if costs[name] or name != "codec_gbps"]
    taken += [words.format(costs[name]) for name, words in OPTIONAL.items() if costs.get(name)]
    measured = calibration["measured"]
    line = (
        f"paratrain: calibration {args.calibration} (measured on {measured['host']} at {measured['at']}, "
        f"{model['model']} on {model['dataset']}, batch {model['batch_size']}"
        + (f"; messages between 2 emulated hosts, {measured['across_hosts']}" if measured.get("across_hosts") else "")
        + f"): {', '.join(taken)}"
    )
    if len(rounds) > 1:
        compute = [r["compute_ms"] for r in rounds]
        line += f"; {len(rounds)} rounds, compute {min(compute):.3g}-{max(compute):.3g} ms a step"
    if (measured.get("steal") or 0.0) >= STEAL_SAID:
        line += f"; a hypervisor took {measured['steal']:.0%} of this machine's CPU while it measured"
    if given:
        line += f"; from the flags: {', '.join(given)}"
    if args.profile:
        line += "; compute measured now (--profile)"
    return [line]
