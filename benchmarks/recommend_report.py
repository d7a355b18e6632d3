"""The settings of benchmarks/simulator_recommend.py, and its verdicts: each setting's real
runs beside the predictions, whether the candidate ranked first is among the measured fastest
(within 10% counts as tied), and the recorded file's report (its .md beside the .json).
``--combine`` judges settings of several recorded files together."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from cluster_common import fastest, median_or_none, record

from paratrain.simulate.recommend import tied_with_first

#: Each model's data, target and epochs, and the optimizer both the prediction's replay and the
#: real runs train with (the CNN trains with Adam here: with SGD it needs far more epochs). A
#: target every candidate reaches in most seeds: the mlp levels off at 0.944-0.956 with 4 and 5
#: workers in 10 epochs, so 0.95 was a coin flip of the seed (results/simulator_recommend_epochs.md).
MODELS = {
    "mlp": {
        "dataset": "digits",
        "target": 0.93,
        "epochs": 10,
        "optimizer": ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
    },
    "cifar_cnn": {
        "dataset": "benchmarks.cluster_common:digits32",
        "target": 0.9,
        "epochs": 6,
        "optimizer": ["--optimizer", "adam", "--lr", "0.001"],
    },
}
#: The targets of the settings recorded before each setting recorded its own.
RECORDED_TARGETS = {"mlp": 0.95, "cifar_cnn": 0.9}
#: model, hosts, CPU share a host, link, the last host's share relative to the others (1: none slow)
SETTINGS = [
    ("mlp", 3, 0.6, "1gbit", 1.0),
    ("mlp", 3, 0.6, "1gbit", 0.5),
    ("mlp", 4, 0.45, "1gbit", 1.0),
    ("mlp", 4, 0.45, "20mbit", 0.5),
    ("mlp", 5, 0.3, "1gbit", 1.0),
    ("mlp", 5, 0.3, "20mbit", 0.5),
    ("mlp", 3, 0.3, "20mbit", 1.0),
    ("mlp", 4, 0.3, "1gbit", 0.5),
    ("cifar_cnn", 4, 0.45, "1gbit", 1.0),
    ("cifar_cnn", 3, 0.6, "1gbit", 0.5),  # 20mbit: a 4.3 MB gradient a second and more a step
]
BATCH = 32


def seconds_to_recorded(run: dict, target: float) -> float | None:
    """A real run's time to ``target`` from the accuracies it recorded: from the end of epoch 1
    to the end of the first epoch at the target, plus one steady epoch; None if none reached it."""
    reached = [seconds for seconds, accuracy in run["epochs"] if (accuracy or 0) >= target]
    return reached[0] + run["epoch_seconds"] if reached else None


def retimed(run: dict, recorded_target: float, target: float) -> float | None:
    """A recorded run's time to ``target``: from its accuracy at each epoch's end while the run
    is in memory; from a record (which keeps its time to ``recorded_target`` only,
    ``recorded_form``) for that target alone."""
    if "epochs" in run:
        return seconds_to_recorded(run, target)
    if target == recorded_target:
        return run["seconds_to_target"]
    raise SystemExit(
        f"--target-accuracy {target:g}: the record keeps each run's time to {recorded_target:g} only, "
        "not its accuracy at every epoch's end"
    )


def recorded_form(document: dict) -> dict:
    """What a record keeps of a document: each prediction's candidates and recommendation, not
    the simulator's whole argument list nor its printed lines, and each real run's numbers, not
    its accuracy at every epoch's end (kept, the records of ten settings passed 500 KB)."""
    settings = []
    for entry in document["settings"]:
        prediction = {k: v for k, v in entry["prediction"].items() if k not in ("arguments", "said")}
        rows = [
            {**row, "passes": [{k: v for k, v in run.items() if k != "epochs"} for run in row["passes"]]}
            for row in entry["verdict"]["rows"]
        ]
        settings.append({**entry, "prediction": prediction, "verdict": {**entry["verdict"], "rows": rows}})
    return {**document, "settings": settings}


def judge(prediction: dict, runs: dict[str, list[dict]]) -> dict:
    """One setting: the real medians beside the predictions, and whether the first-ranked
    candidate is among the measured fastest."""
    rows = []
    for c in prediction["candidates"]:
        passes = runs[c["candidate"]]
        real = statistics.median(p["examples_per_second"] for p in passes)
        rows.append(
            {
                "candidate": c["candidate"],
                "same_updates": c["same_updates"],
                "examples_per_second": real,
                "predicted_examples_per_second": c["examples_per_second"],
                "error": c["examples_per_second"] / real - 1,
                "seconds_to_target": median_or_none([p["seconds_to_target"] for p in passes]),
                "predicted_seconds_to_target": c["median_seconds"],
                # the prediction's range over its calibration's rounds (none from a calibration without them)
                "predicted_range": c.get("examples_per_second_range"),
                "predicted_seconds_range": c.get("seconds_range"),
                "test_accuracy": statistics.median(p["test_accuracy"] for p in passes),
                "passes": passes,
            }
        )
    same = [r for r in rows if r["same_updates"]]
    by_rate = max(same, key=lambda r: r["predicted_examples_per_second"])["candidate"]
    timed = [r for r in rows if r["predicted_seconds_to_target"] is not None]
    by_time = min(timed, key=lambda r: r["predicted_seconds_to_target"])["candidate"] if timed else None
    rate_tie = fastest({r["candidate"]: r["examples_per_second"] for r in same}, larger=True)
    time_tie = fastest({r["candidate"]: r["seconds_to_target"] for r in rows}, larger=False)
    verdict = {
        "rows": rows,
        "by_rate": {"predicted": by_rate, "measured": rate_tie, "right": by_rate in rate_tie},
        "by_time": {
            "predicted": by_time,
            "measured": time_tie,
            "right": by_time in time_tie or (by_time is None and not time_tie),
        },
    }
    if all(r["predicted_range"] for r in rows):  # the candidates the prediction could not tell from its first
        first = next(r for r in same if r["candidate"] == by_rate)["predicted_range"]
        tied = [r["candidate"] for r in same if tied_with_first(first, r["predicted_range"], larger=True)]
        verdict["by_rate"] |= {"predicted_tied": tied, "tied_right": bool(set(tied) & set(rate_tie))}
        if by_time is not None:
            first = next(r for r in timed if r["candidate"] == by_time)["predicted_seconds_range"]
            tied = [r["candidate"] for r in timed if tied_with_first(first, r["predicted_seconds_range"], larger=False)]
            verdict["by_time"] |= {"predicted_tied": tied, "tied_right": bool(set(tied) & set(time_tie))}
    return verdict


def inside(value: float | None, spread: list[float] | None) -> bool | None:
    """Whether a real value lies in a predicted range (None: no range, or nothing to place)."""
    return None if value is None or not spread else spread[0] <= value <= spread[1]


def setting_words(setting: list) -> str:
    model, hosts, cpu, link, slow = setting
    slowest = f", host {hosts - 1} at {cpu * slow:g}" if slow < 1 else ""
    return f"{model}, {hosts} hosts at {cpu:g}, {link}{slowest}"


def report(document: dict, out: Path) -> None:
    own = [entry["calibration"] for entry in document["settings"] if "calibration" in entry]
    across = sorted(
        {
            c["measured"]["across_hosts"]
            for c in [*document["calibrations"].values(), *own]
            if c["measured"].get("across_hosts")
        }
    )
    each = bool(own) and len(own) == len(document["settings"])
    lines = [
        "# The user's path on emulated clusters: calibrate, --recommend, then every candidate for real",
        "",
        f"`sudo python benchmarks/simulator_recommend.py --repeats {document['setup']['repeats']}"
        + "".join(
            f" --{name.replace('_', '-')} {value}"
            for name, value in (
                ("epochs", ",".join(f"{k}={v}" for k, v in (document["setup"].get("epochs") or {}).items())),
                ("throttle_from", document["setup"].get("throttle_from", "start")),
            )
            if value not in ("", "start")
        )
        + "`"
        + (
            f" (the real runs; the predictions again with `{document['real_runs_from']}`)"
            if "real_runs_from" in document
            else ""
        )
        + (
            f" (settings combined from {', '.join(f'`{name}`' for name in document['combined_from'])}: each with its "
            "file's calibration and real runs, made in one session)"
            if "combined_from" in document
            else ""
        )
        + (
            ". Calibrated on this machine before every setting, for its prediction alone"
            if each
            else ". Calibrated once per model on this machine, and again just before each setting that says when, "
            "for its prediction alone"
            if own
            else ". Calibrated once per model on this machine"
        )
        + " (`paratrain simulate --calibrate`, whole cores"
        + (f"; with `--across-hosts`, its messages between 2 emulated hosts: {', '.join(across)}" if across else "")
        + "), then `paratrain simulate --recommend` "
        "with the cluster's flags and `--calibration` (no number given by hand); every candidate it ranks then ran on "
        f"`paratrain cluster run` with those hosts, batch {BATCH} a worker, the optimizer named under each setting "
        "(the prediction's replay trains with it too); real = the "
        "median of the passes. Rates count from the end of epoch 1; time to the target is to the end of the first "
        "epoch that reaches it, from the end of epoch 1, plus a steady epoch. Within 10% counts as tied.",
        "",
    ]
    errors = []
    same_errors = []
    rate_right = 0
    time_right = 0
    placed: list[bool] = []  # each real rate and time against its predicted range, where there is one
    tied_right: dict[str, int] = {}  # settings whose predicted ties hold a measured fastest
    for entry in document["settings"]:
        verdict = entry["verdict"]
        rate_right += verdict["by_rate"]["right"]
        time_right += verdict["by_time"]["right"]
        lines += [
            f"## {setting_words(entry['setting'])} (target {entry.get('target', RECORDED_TARGETS[entry['setting'][0]]):g} "
            "test accuracy; "
            f"real runs' seeds: {', '.join(map(str, entry.get('seeds', [0] * document['setup']['repeats'])))}; "
            f"`{' '.join(entry.get('optimizer', MODELS['mlp']['optimizer']))}`"
            + (f"; from `{entry['from']}`" if "from" in entry else "")
            + (calibration_words(entry["calibration"]) if "calibration" in entry else "")
            + steal_words(verdict)
            + ")",
            "",
            f"{entry['prediction']['recommendation']}",
            "",
            "| candidate | real examples/s | predicted | error | real s to target | predicted | test accuracy |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in verdict["rows"]:
            errors.append(abs(r["error"]))
            if r["same_updates"]:
                same_errors.append(abs(r["error"]))
            real_t, sim_t = r["seconds_to_target"], r["predicted_seconds_to_target"]
            spread, seconds = r.get("predicted_range"), r.get("predicted_seconds_range")
            placed += [x for x in (inside(r["examples_per_second"], spread), inside(real_t, seconds)) if x is not None]
            lines.append(
                f"| {r['candidate']}{'' if r['same_updates'] else ' (other updates)'} | {r['examples_per_second']:,.0f} "
                f"| {r['predicted_examples_per_second']:,.0f}{f' ({spread[0]:,.0f}-{spread[1]:,.0f})' if spread else ''} "
                f"| {r['error']:+.0%} | {'not reached' if real_t is None else f'{real_t:.2f}'} "
                f"| {'not reached' if sim_t is None else f'{sim_t:.2f}'}"
                f"{f' ({seconds[0]:.2f}-{seconds[1]:.2f})' if seconds else ''} | {r['test_accuracy']:.3f} |"
            )
        for name, words in (("by_rate", "by examples/s (one process's updates)"), ("by_time", "by time to the target")):
            v = verdict[name]
            tied = v.get("predicted_tied")
            if tied is not None:
                tied_right[name] = tied_right.get(name, 0) + v["tied_right"]
            lines.append(
                f"- {words}: predicted `{v['predicted']}`; measured fastest: "
                f"{', '.join(f'`{c}`' for c in v['measured']) or 'none reached'}: "
                f"{'right' if v['right'] else 'wrong'}"
                + (
                    f"; tied within the calibration's rounds: {', '.join(f'`{c}`' for c in tied)} "
                    f"({'one of them' if v['tied_right'] else 'none of them'} among the measured fastest)"
                    if tied and len(tied) > 1
                    else ""
                )
            )
        lines.append("")
    count = len(document["settings"])
    if count:
        lines.append(
            f"**Fastest named: {rate_right} of {count} settings by examples/s, {time_right} of {count} by time to the "
            f"target; median absolute error of examples/s {statistics.median(errors):.0%} over {len(errors)} "
            f"candidates ({statistics.median(same_errors):.0%} over the {len(same_errors)} with one process's "
            "updates).**"
        )
    if placed:
        ranged = sum("predicted_tied" in e["verdict"]["by_rate"] for e in document["settings"])
        lines += [
            "",
            f"Predicted ranges (each candidate's predictions over its calibration's rounds, in brackets): "
            f"{sum(placed)} of {len(placed)} real rates and times inside them; a measured fastest among the "
            f"candidates tied with the first within them in {tied_right.get('by_rate', 0)} of {ranged} settings by "
            f"examples/s, {tied_right.get('by_time', 0)} of {ranged} by time to the target.",
        ]
    record(out, recorded_form(document), lines)


def calibration_words(calibration: dict) -> str:
    """When a setting's own calibration was measured, its compute a step (what drifts), its
    rounds' range of it and what a hypervisor took while it measured, where recorded."""
    costs, measured = calibration["costs"], calibration["measured"]
    words = f"; calibrated at {measured['at'][11:16]} UTC, compute {costs['compute_ms']:.3f} ms a step"
    if calibration.get("rounds"):
        compute = [r["compute_ms"] for r in calibration["rounds"]]
        words += f" ({min(compute):.3f}-{max(compute):.3f} over its rounds)"
    if measured.get("steal") is not None:
        words += f", a hypervisor took {measured['steal']:.0%} of the CPU while it measured"
    return words


def steal_words(verdict: dict) -> str:
    """What a hypervisor took of the machine's CPU during a setting's real runs (their median
    and highest), where recorded."""
    steals = [p["steal"] for r in verdict["rows"] for p in r["passes"] if p.get("steal") is not None]
    if not steals:
        return ""
    return (
        f"; a hypervisor took {statistics.median(steals):.0%} of the CPU in its real runs (at most {max(steals):.0%})"
    )


def combine(paths: list[str], out: Path) -> None:
    """The recorded settings of ``paths`` judged together (each file's own calibration and runs)."""
    settings: dict[int, dict] = {}
    calibrations: dict[str, dict] = {}
    for path in map(Path, paths):
        recorded = json.loads(path.read_text())
        for entry in recorded["settings"]:
            if entry["number"] in settings:
                print(
                    f"--combine: setting {entry['number']} is in {settings[entry['number']]['from']} and in "
                    f"{path.name}; give each setting from one file",
                    file=sys.stderr,
                )
                raise SystemExit(2)
            settings[entry["number"]] = {**entry, "from": path.name}
        calibrations.update({f"{model} ({path.name})": c for model, c in recorded["calibrations"].items()})
        repeats = recorded["setup"]["repeats"]
    document = {
        "setup": {"repeats": repeats},
        "calibrations": calibrations,
        "settings": [settings[n] for n in sorted(settings)],
        "combined_from": [Path(p).name for p in paths],
    }
    report(document, out)
