"""``paratrain simulate --recommend``: which strategy, with which key options, is fastest on a cluster
described as ``paratrain cluster run`` describes one (``--hosts``, ``--cpu``, ``--link``, ``--host I:cpu=X``).

Every candidate runs on the same hosts: ``allreduce``, ``local-sgd`` at several ``--sync-every``, the parameter
servers with their shard on a host of its own, and ``fsdp`` where hosts have whole cores (the quota engine
does not model it). One host at a lower CPU share is a slow worker; hosts under a share run under its quota
with ``paratrain cluster``'s 10 ms period. Candidates are ranked by examples/s among those that make plain
SGD's updates, or with ``--target-accuracy``/``--target-loss`` by simulated time to the target (target.py).
See docs/simulator_recommend.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from paratrain.errors import ConfigError
from paratrain.simulate.flags import has_target

#: A quota's period on ``paratrain cluster``'s hosts, in milliseconds (cluster/usage.py's PERIOD_US).
CLUSTER_PERIOD_MS = 10.0
#: Strategies whose updates are plain SGD's: their examples/s compare directly.
SAME_UPDATES = ("allreduce", "fsdp", "ps-sync", "ps-backup", "ps-async")
#: Train's flags for the prediction's options whose names differ.
TRAIN_FLAGS = {"period": "--sync-every"}
#: Two calibrations whose compute a step differs by no more than this are the same machine.
SAME_SPEED = 0.10
UNITS = {"bit": 1e-9, "kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}


@dataclass
class Candidate:
    strategy: str
    workers: int
    options: dict[str, Any] = field(default_factory=dict)
    """Overrides of the prediction's flags (``period``, ``backup_workers``, ``staleness_bound``)."""

    @property
    def label(self) -> str:
        """The strategy and its options as ``paratrain train`` takes them."""
        words = [self.strategy]
        for name, value in self.options.items():
            words.append(f"{TRAIN_FLAGS.get(name, '--' + name.replace('_', '-'))} {value}")
        return " ".join(words)


def rate_gbps(text: str) -> float:
    """A link rate in tc's units (``1gbit``, ``100mbit``), in Gb/s."""
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text.removesuffix(unit)) * UNITS[unit]
            except ValueError:
                break
    raise ConfigError(f"--link must be a rate in tc's units (e.g. 1gbit, 100mbit), got {text!r}")


def own_calibrations(args: argparse.Namespace) -> dict[int, tuple[str, float]]:
    """The hosts measured on their own (``--host I:calibration=FILE``, each host's settings
    left in ``args.host`` without it): host I's calibration file and its compute per step
    over ``--calibration``'s, the other hosts'. A ratio within SAME_SPEED of 1 is the same
    machine measured twice."""
    from paratrain.simulate.calibration import load_for  # deferred: reads files only when asked

    own = {}
    kept = []
    theirs = None
    for text in args.host:
        index, _, settings = text.partition(":")
        rest = []
        for setting in settings.split(","):
            key, _, value = setting.partition("=")
            if key != "calibration":
                rest.append(setting)
                continue
            if args.calibration is None:
                raise ConfigError(
                    f"--host {text}: a host's own calibration is weighed against the other hosts': give theirs "
                    "as --calibration FILE"
                )
            if theirs is None:
                theirs = load_for(args.calibration, args)["costs"]["compute_ms"]
            mine = load_for(value, args, f"--host {index}:calibration={value}")["costs"]["compute_ms"]
            ratio = mine / theirs if theirs else 1.0
            own[int(index) if index.isdigit() else -1] = (value, 1.0 if abs(ratio - 1) <= SAME_SPEED else ratio)
        if rest:
            kept.append(f"{index}:{','.join(rest)}")
    args.host = kept
    return own


def describe(args: argparse.Namespace) -> None:
    """Set the prediction's flags for the described hosts on ``args`` (before a calibration
    is applied: a message's CPU counts on hosts under a quota only), the hosts in words
    (``hosts_words``) and the slow host (``slow_host``, ``slow_factor``: its CPU share's
    ratio to the others' times its own calibration's compute over theirs)."""
    from paratrain.cluster.run import host_specs  # deferred: the emulated cluster's parser

    own = own_calibrations(args)
    specs = host_specs(args)
    if len(specs) < 2:
        raise ConfigError("--recommend compares strategies on 2 or more --hosts")
    if -1 in own or max(own, default=0) >= len(specs):
        raise ConfigError(f"--host I:calibration=FILE: expected I < --hosts {len(specs)}")
    ratios = {i: ratio for i, (_, ratio) in own.items()}
    factors = [args.cpu / spec.cpu * ratios.get(i, 1.0) for i, spec in enumerate(specs)]
    slow = [i for i, factor in enumerate(factors) if factor > 1]
    if len(slow) > 1 or any(factor < 1 for factor in factors):
        raise ConfigError(
            "--recommend models one host slower than the others (--host I:cpu=X below --cpu, or "
            "I:calibration=FILE slower than --calibration's), no more"
        )
    if args.cpu_share is not None or args.straggler != "none":
        raise ConfigError(
            "--recommend takes the hosts' CPU and a slow host from --cpu and --host, not --cpu-share or --straggler"
        )
    words = f"{len(specs)} hosts at {args.cpu:g} of a core"
    if args.cpu < 1:
        args.cpu_share, args.cpu_period_ms = args.cpu, CLUSTER_PERIOD_MS
    if args.link:
        args.bandwidth_gbps = rate_gbps(args.link)
        words += f", {args.link} links"
    args.slow_host, args.slow_factor = (slow[0], factors[slow[0]]) if slow else (None, 1.0)
    for i in slow:
        said = [f"at {specs[i].cpu:g}"] if specs[i].cpu < args.cpu else []
        if ratios.get(i, 1.0) > 1:
            said.append(f"{ratios[i]:.2g}x the compute a step ({own[i][0]})")
        words += f", host {i} {' and '.join(said)}"
    args.hosts_words = words


def candidates(hosts: int, quota: bool) -> list[Candidate]:
    found = [Candidate("allreduce", hosts)]
    if not quota:
        found.append(Candidate("fsdp", hosts))
    found += [
        Candidate("ps-sync", hosts - 1),
        Candidate("ps-async", hosts - 1),
        Candidate("ps-async", hosts - 1, {"staleness_bound": 2}),
    ]
    if hosts >= 3:  # a shard, N workers and one backup worker
        found.append(Candidate("ps-backup", hosts - 2, {"backup_workers": 1}))
    found += [Candidate("local-sgd", hosts, {"period": period}) for period in (4, 8, 16)]
    return found


def flags_of(base: argparse.Namespace, candidate: Candidate) -> argparse.Namespace:
    """The prediction's flags for one candidate: its options, and the slow host as its worker
    (under a parameter server host 0 is the shard, so host I is worker I - 1)."""
    flags = argparse.Namespace(**{**vars(base), **candidate.options})
    slow = base.slow_host
    if slow is not None:
        worker = slow - 1 if candidate.strategy.startswith("ps-") else slow
        flags.straggler = f"fixed:{max(worker, 0)}:{base.slow_factor:g}"
    return flags


def recommend(
    args: argparse.Namespace, model: Any, splits: Any, compute_s: float, build_cluster: Any, options: Any
) -> dict[str, Any]:
    """Every candidate on the hosts ``describe`` set on ``args`` (``build_cluster(flags,
    workers, model, compute_s)`` and ``options(flags)`` as cli.py makes them), ranked; and
    the line."""
    from paratrain.simulate.calibration import round_compute_s, rounds_of
    from paratrain.simulate.target import target_words, time_to_target

    targeted = has_target(args)
    rounds = rounds_of(args)
    rows = []
    for candidate in candidates(args.hosts, args.cpu_share is not None):
        flags = flags_of(args, candidate)
        cluster = build_cluster(flags, candidate.workers, model, compute_s)
        rate = _rate(flags, candidate, cluster, options)
        row = {
            "candidate": candidate.label,
            "strategy": candidate.strategy,
            "workers": candidate.workers,
            "examples_per_second": rate,
            "same_updates": candidate.strategy in SAME_UPDATES,
        }
        if targeted:
            (reached,) = time_to_target(flags, [candidate.strategy], cluster, model, splits, options(flags))
            row.update(seconds=reached["seconds"], median_seconds=reached["median_seconds"])
        if rounds:
            rates = [rate]
            for measured in rounds:
                own = flags_of(measured, candidate)
                cluster = build_cluster(own, candidate.workers, model, round_compute_s(measured, compute_s))
                rates.append(_rate(own, candidate, cluster, options))
            row["examples_per_second_range"] = [min(rates), max(rates)]
            if targeted and row["median_seconds"] is not None:  # the same steps, at each round's pace
                row["seconds_range"] = [row["median_seconds"] * rate / r for r in (max(rates), min(rates))]
        rows.append(row)
    same = sorted((r for r in rows if r["same_updates"]), key=lambda r: -r["examples_per_second"])
    line = f"on this cluster ({args.hosts_words}): by examples/s, " + _ranked(
        same, "examples_per_second", lambda v: f"{v:,.0f}", larger=True
    )
    if targeted:
        ranked = sorted(rows, key=lambda r: (r["median_seconds"] is None, r["median_seconds"] or 0.0))
        first = [r for r in ranked if r["median_seconds"] is not None]
        line += f"; to {target_words(args)} first: " + (
            _ranked(first, "seconds", lambda v: f"{v:.3g} s", larger=False, value="median_seconds", between=" in ")
            or f"none within {args.epochs} epochs"
        )
    return {"hosts": args.hosts_words, "candidates": rows, "recommendation": line}


def _rate(flags: argparse.Namespace, candidate: Candidate, cluster: Any, options: Any) -> float:
    from paratrain.simulate.simulator import simulate  # deferred: the engine

    outcome = simulate(candidate.strategy, cluster, flags.steps, seed=flags.seed, **options(flags))
    return outcome.summary(flags.batch_size)["examples_per_second"]


def tied_with_first(first: list[float], theirs: list[float], larger: bool) -> bool:
    """Whether a candidate's range over a calibration's rounds reaches the first-ranked one's,
    so that the machine's spread while it was calibrated cannot tell them apart: for a rate
    (``larger`` is better) its highest at or above the first's lowest, for a time its lowest
    at or below the first's highest."""
    return theirs[1] >= first[0] if larger else theirs[0] <= first[1]


def _ranked(rows: list[dict], key: str, words: Any, larger: bool, value: str = "", between: str = " ") -> str:
    """The first 3 of ``rows`` (ranked best first) with their ``value`` (default ``key``) and,
    given a calibration's rounds, their range over the rounds (``{key}_range``); and which
    are tied with the first (``tied_with_first``)."""
    value = value or key
    parts = []
    for row in rows[:3]:
        spread = row.get(f"{key}_range")
        around = f" ({words(spread[0]).removesuffix(' s')}-{words(spread[1])})" if spread else ""
        parts.append(f"{row['candidate']}{between}{words(row[value])}{around}")
    text = ", ".join(parts)
    if rows and rows[0].get(f"{key}_range"):
        tied = [r["candidate"] for r in rows[1:] if tied_with_first(rows[0][f"{key}_range"], r[f"{key}_range"], larger)]
        if tied:
            text += f" ({rows[0]['candidate']} tied with {', '.join(tied)} within the calibration's rounds)"
    return text
