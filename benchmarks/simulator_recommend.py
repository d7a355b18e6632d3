"""The user's path through the simulator, checked on emulated clusters: calibrate on this
machine, ask ``paratrain simulate --recommend`` about a cluster, then run every strategy it
ranked on that cluster for real.

For each model, once: ``paratrain simulate --calibrate FILE --model M`` on this machine's
whole cores (no number given by hand). For each setting (hosts, CPU share, link, one slow
host or none; the mlp on digits and cifar_cnn on benchmarks.digits32):

1. ``paratrain simulate --recommend --hosts N --cpu X --link L [--host I:cpu=Y]
   --calibration FILE --target-accuracy A --epochs E --optimizer O``: every candidate's predicted
   examples/s and time to the target, as the user sees them;
2. every candidate for real, ``--repeats`` passes (a pass runs each candidate once, so
   drift of the shared machine hits them all): ``paratrain cluster run`` on the same hosts
   (``--pin never``: the hosts share this machine's cores as the kernel places them), the
   same flags and the model's optimizer (MODELS), as the prediction's replay; pass k with
   ``--seed k-1`` (the data order and the first parameters differ, as between the
   prediction's seeds). Examples/s count
   from the end of epoch 1 (every host has started; cluster_common.py); time to the target
   is from the end of epoch 1 to the end of the first epoch at the target, plus one steady
   epoch (the run's own first epoch, without the hosts' staggered start). The real number of
   a candidate is the median over its passes.

A setting's prediction is right when the candidate it ranks first is among the measured
fastest, two candidates within 10% of each other counting as tied: by examples/s among the
candidates that make one process's updates (allreduce, the parameter servers), and by time to
the target among all.

    sudo .venv/bin/python benchmarks/simulator_recommend.py [--repeats 2] [--only 1,4]

(``--only`` adds settings to the recorded file with the calibrations recorded in it;
``--repredict RECORDED.json --out OTHER [--only 1,4]`` calibrates and predicts the recorded
settings, or those of ``--only``, again, against their recorded real runs; with
``--recorded-calibrations`` it predicts with the calibrations measured beside those runs, and
with ``--target-accuracy A`` it asks and judges the time to another target: the real runs'
times to it come from the test accuracy they recorded at every epoch's end. ``--across-hosts``
calibrates with ``--calibrate --across-hosts``: messages measured between two emulated hosts.
``--combine A.json B.json --out C`` judges the settings of recorded files together, each
setting with the calibration and the real runs of its own file: no setting in two files.
``--calibrate-each`` calibrates again before every setting (with ``--repredict``: for each
setting predicted again) and predicts it with that
calibration, recorded with the setting: what a user does before asking about a cluster, and
what keeps a setting's prediction and its real runs on the same machine when its speed
drifts within a session (a whole record takes more than one; --combine then joins them).)

Writes benchmarks/results/simulator_recommend.json and .md after every setting (a run cut
short keeps the settings it finished; ``--only`` runs some again into the same file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cluster_common import RESULTS, cluster_train, fastest, median_or_none, paratrain, record

from paratrain.cpu_steal import cpu_times, stolen_share

#: Each model's data, target and epochs, and the optimizer both the prediction's replay and the
#: real runs train with (the CNN trains with Adam here: with SGD it needs far more epochs). A
#: target every candidate reaches in most seeds: the mlp levels off at 0.944-0.956 with 4 and 5
#: workers in 10 epochs, so 0.95 was a coin flip of the seed (results/simulator_recommend_epochs.md).
MODELS = {
    "mlp": {"dataset": "digits", "target": 0.93, "epochs": 10,
            "optimizer": ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]},
    "cifar_cnn": {"dataset": "benchmarks.digits32:load", "target": 0.9, "epochs": 6,
                  "optimizer": ["--optimizer", "adam", "--lr", "0.001"]},
}  # fmt: skip
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


def hosts_flags(hosts: int, cpu: float, link: str, slow: float) -> list[str]:
    flags = ["--hosts", str(hosts), "--cpu", f"{cpu:g}", "--link", link]
    return flags + (["--host", f"{hosts - 1}:cpu={cpu * slow:g}"] if slow < 1 else [])


def model_flags(model: str) -> list[str]:
    """The model, its data, the batch and the optimizer: what the calibration, the prediction and
    the real runs share."""
    return ["--model", model, "--dataset", MODELS[model]["dataset"], "--batch-size", str(BATCH),
            *MODELS[model]["optimizer"]]  # fmt: skip


def train_flags(candidate: dict) -> list[str]:
    """``paratrain train`` flags of a --recommend candidate (its label: the strategy and its options)."""
    words = candidate["candidate"].split()
    return ["--strategy", words[0], "--workers", str(candidate["workers"]), *words[1:]]


def target_of(model: str, args: argparse.Namespace) -> float:
    return args.target_accuracy if args.target_accuracy is not None else MODELS[model]["target"]


def epochs_of(model: str, args: argparse.Namespace) -> int:
    return (args.epochs or {}).get(model, MODELS[model]["epochs"])


def model_epochs(text: str) -> dict[str, int]:
    """``--epochs mlp=30,cifar_cnn=6``: epochs by model."""
    try:
        epochs = {name: int(count) for name, _, count in (part.partition("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MODEL=N[,MODEL=N], got {text!r}") from None
    unknown = set(epochs) - set(MODELS)
    if unknown or min(epochs.values()) < 2:
        raise argparse.ArgumentTypeError(f"models are {', '.join(MODELS)}, epochs at least 2: got {text!r}")
    return epochs


def predict(setting: tuple, calibration: Path, args: argparse.Namespace, folder: Path) -> dict:
    model, hosts, cpu, link, slow = setting
    out = folder / "prediction.json"
    started = time.perf_counter()
    result = paratrain(
        "simulate", "--recommend", *hosts_flags(hosts, cpu, link, slow), "--calibration", str(calibration),
        *model_flags(model), "--target-accuracy", str(target_of(model, args)), "--epochs", str(epochs_of(model, args)),
        "--json-out", str(out),
    )  # fmt: skip
    prediction = json.loads(out.read_text())
    prediction["seconds_to_predict"] = time.perf_counter() - started
    prediction["said"] = result.stdout.strip().splitlines()
    return prediction


def real_run(setting: tuple, candidate: dict, args: argparse.Namespace, folder: Path, seed: int) -> dict:
    model, hosts, cpu, link, slow = setting
    train = [*train_flags(candidate), *model_flags(model), "--epochs", str(epochs_of(model, args)), "--seed", str(seed),
             "--timeout", "600"]  # fmt: skip
    cluster = [*hosts_flags(hosts, cpu, link, slow), "--pin", "never", "--throttle-from", args.throttle_from]
    before = cpu_times()
    metrics = cluster_train(cluster, train, folder / "m.json")
    steal = stolen_share(before, cpu_times())
    start = metrics["history"][0]["wall_seconds"]
    run = {
        "examples_per_second": metrics["steady_examples_per_second"],
        "test_accuracy": metrics["test_accuracy"],
        # seconds from the end of epoch 1 and test accuracy at each epoch's end: another target's time
        "epochs": [[h["wall_seconds"] - start, h["test_accuracy"]] for h in metrics["history"]],
        "epoch_seconds": metrics["epoch_seconds"],
        "steal": steal,  # the share of the machine's CPU time a hypervisor gave to other machines
    }
    return {**run, "seconds_to_target": seconds_to_recorded(run, target_of(model, args))}


def seconds_to_recorded(run: dict, target: float) -> float | None:
    """A real run's time to ``target`` from the accuracies it recorded: from the end of epoch 1
    to the end of the first epoch at the target, plus one steady epoch; None if none reached it."""
    reached = [seconds for seconds, accuracy in run["epochs"] if (accuracy or 0) >= target]
    return reached[0] + run["epoch_seconds"] if reached else None


def judge(prediction: dict, runs: dict[str, list[dict]]) -> dict:
    """One setting: the real medians beside the predictions, and whether the first-ranked
    candidate is among the measured fastest."""
    rows = []
    for c in prediction["candidates"]:
        passes = runs[c["candidate"]]
        real = statistics.median(p["examples_per_second"] for p in passes)
        rows.append({
            "candidate": c["candidate"], "same_updates": c["same_updates"],
            "examples_per_second": real, "predicted_examples_per_second": c["examples_per_second"],
            "error": c["examples_per_second"] / real - 1,
            "seconds_to_target": median_or_none([p["seconds_to_target"] for p in passes]),
            "predicted_seconds_to_target": c["median_seconds"],
            # the prediction's range over its calibration's rounds (none from a calibration without them)
            "predicted_range": c.get("examples_per_second_range"),
            "predicted_seconds_range": c.get("seconds_range"),
            "test_accuracy": statistics.median(p["test_accuracy"] for p in passes),
            "passes": passes,
        })  # fmt: skip
    same = [r for r in rows if r["same_updates"]]
    by_rate = max(same, key=lambda r: r["predicted_examples_per_second"])["candidate"]
    timed = [r for r in rows if r["predicted_seconds_to_target"] is not None]
    by_time = min(timed, key=lambda r: r["predicted_seconds_to_target"])["candidate"] if timed else None
    rate_tie = fastest({r["candidate"]: r["examples_per_second"] for r in same}, larger=True)
    time_tie = fastest({r["candidate"]: r["seconds_to_target"] for r in rows}, larger=False)
    verdict = {
        "rows": rows,
        "by_rate": {"predicted": by_rate, "measured": rate_tie, "right": by_rate in rate_tie},
        "by_time": {"predicted": by_time, "measured": time_tie, "right": by_time in time_tie or (by_time is None and not time_tie)},
    }  # fmt: skip
    if all(r["predicted_range"] for r in rows):  # the candidates the prediction could not tell from its first
        first = next(r for r in same if r["candidate"] == by_rate)["predicted_range"]
        tied = [r["candidate"] for r in same if r["predicted_range"][1] >= first[0]]
        verdict["by_rate"] |= {"predicted_tied": tied, "tied_right": bool(set(tied) & set(rate_tie))}
        if by_time is not None:
            first = next(r for r in timed if r["candidate"] == by_time)["predicted_seconds_range"]
            tied = [r["candidate"] for r in timed if r["predicted_seconds_range"][0] <= first[1]]
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
    across = sorted({
        c["measured"]["across_hosts"] for c in [*document["calibrations"].values(), *own] if c["measured"].get("across_hosts")
    })  # fmt: skip
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
    errors, same_errors, rate_right, time_right = [], [], 0, 0
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
            lines.append(f"- {words}: predicted `{v['predicted']}`; measured fastest: "
                         f"{', '.join(f'`{c}`' for c in v['measured']) or 'none reached'}: "
                         f"{'right' if v['right'] else 'wrong'}"
                         + (f"; tied within the calibration's rounds: {', '.join(f'`{c}`' for c in tied)} "
                            f"({'one of them' if v['tied_right'] else 'none of them'} among the measured fastest)"
                            if tied and len(tied) > 1 else ""))  # fmt: skip
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
    record(out, document, lines)


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
                print(f"--combine: setting {entry['number']} is in {settings[entry['number']]['from']} and in "
                      f"{path.name}; give each setting from one file", file=sys.stderr)  # fmt: skip
                raise SystemExit(2)
            settings[entry["number"]] = {**entry, "from": path.name}
        calibrations.update({f"{model} ({path.name})": c for model, c in recorded["calibrations"].items()})
        repeats = recorded["setup"]["repeats"]
    document = {"setup": {"repeats": repeats}, "calibrations": calibrations,
                "settings": [settings[n] for n in sorted(settings)], "combined_from": [Path(p).name for p in paths]}  # fmt: skip
    report(document, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--throttle-from", default="start", choices=("start", "training"),
        help="when the real runs' hosts begin at their CPU shares (paratrain cluster run --throttle-from; training: "
        "start-up at the machine's speed, benchmarks/throttle_from.py compares the two)",
    )  # fmt: skip
    parser.add_argument("--only", help="comma-separated setting numbers (1-based) to run, into the same file")
    parser.add_argument("--out", default=str(RESULTS / "simulator_recommend"))
    parser.add_argument("--target-accuracy", type=float, help="instead of each model's target (MODELS)")
    parser.add_argument("--epochs", type=model_epochs, metavar="MODEL=N[,MODEL=N]",
                        help="instead of these models' epochs (MODELS): longer real runs")  # fmt: skip
    parser.add_argument("--across-hosts", action="store_true", help="calibrate with --across-hosts")
    parser.add_argument("--calibrate-each", action="store_true",
                        help="calibrate again before every setting, for its prediction (recorded with the setting)")  # fmt: skip
    parser.add_argument("--recorded-calibrations", action="store_true",
                        help="with --repredict: the calibrations recorded beside the real runs, not measured again")  # fmt: skip
    parser.add_argument(
        "--repredict",
        metavar="RECORDED.json",
        help="no real runs: calibrate and predict the recorded ones' settings again",
    )
    parser.add_argument("--combine", nargs="+", metavar="RECORDED.json", help="judge recorded files' settings together")
    args = parser.parse_args()
    if args.calibrate_each and (args.recorded_calibrations or args.combine):
        parser.error(
            "--calibrate-each calibrates before each setting; --recorded-calibrations and --combine measure none"
        )
    if args.recorded_calibrations and not args.repredict:
        parser.error("--recorded-calibrations is for --repredict")
    out = Path(args.out)
    if args.combine:
        combine(args.combine, out)
        return
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(1, len(SETTINGS) + 1)
    document = {
        "setup": {
            "repeats": args.repeats,
            "throttle_from": args.throttle_from,
            "epochs": args.epochs,
            "calibrate_each": args.calibrate_each,
        },
        "calibrations": {},
        "settings": [],
    }
    if args.only and out.with_suffix(".json").exists():
        document = json.loads(out.with_suffix(".json").read_text())
    if args.repredict:
        repredict(json.loads(Path(args.repredict).read_text()), args, out, set(chosen))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for number in chosen:
            setting = SETTINGS[number - 1]
            if args.calibrate_each:  # this machine now, just before the runs it predicts
                calibration = calibrate(setting[0], folder / f"calibration-{number}.json", args.across_hosts)
            else:
                calibration = calibrated(setting[0], document, folder, args.across_hosts)
            prediction = predict(setting, calibration, args, folder)
            print(f"setting {number} ({setting_words(list(setting))}): {prediction['recommendation']}", flush=True)
            runs: dict[str, list[dict]] = {c["candidate"]: [] for c in prediction["candidates"]}
            for repeat in range(args.repeats):
                for candidate in prediction["candidates"]:
                    run = real_run(setting, candidate, args, folder, seed=repeat)
                    runs[candidate["candidate"]].append(run)
                    print(f"  pass {repeat + 1} {candidate['candidate']:32} {run['examples_per_second']:8,.0f} "
                          f"examples/s, to target {run['seconds_to_target']}", flush=True)  # fmt: skip
            entry = {"number": number, "setting": list(setting), "prediction": prediction, "target": target_of(setting[0], args),
                     "verdict": judge(prediction, runs), "seeds": list(range(args.repeats)),
                     "optimizer": MODELS[setting[0]]["optimizer"]}  # fmt: skip
            if args.calibrate_each:
                entry["calibration"] = json.loads(calibration.read_text())
            document["settings"] = [e for e in document["settings"] if e["number"] != number] + [entry]
            document["settings"].sort(key=lambda e: e["number"])
            report(document, out)


def calibrated(model: str, document: dict, folder: Path, across: bool = False) -> Path:
    """The calibration file of ``model``: the one ``document`` recorded, else measured now
    (``across``: its messages between two emulated hosts, --across-hosts)."""
    calibration = folder / f"calibration-{model}.json"
    if model in document["calibrations"]:
        calibration.write_text(json.dumps(document["calibrations"][model]))
    elif not calibration.exists():
        document["calibrations"][model] = json.loads(calibrate(model, calibration, across).read_text())
    return calibration


def calibrate(model: str, calibration: Path, across: bool = False) -> Path:
    """``paratrain simulate --calibrate`` of ``model`` into ``calibration``, measured now."""
    paratrain("simulate", "--calibrate", str(calibration), *model_flags(model), *(["--across-hosts"] if across else []))
    return calibration


def setting_calibration(entry: dict, folder: Path) -> Path | None:
    """The calibration a setting recorded as its own (``--calibrate-each``), as a file; None
    for a setting that used its model's."""
    if "calibration" not in entry:
        return None
    calibration = folder / f"calibration-{entry['number']}.json"
    calibration.write_text(json.dumps(entry["calibration"]))
    return calibration


def repredict(recorded: dict, args: argparse.Namespace, out: Path, chosen: set[int]) -> None:
    """The recorded real runs against this code's predictions: calibrated afresh, each
    ``chosen`` setting predicted again (the real runs do not depend on the simulator)."""
    settings = [entry for entry in recorded["settings"] if entry["number"] in chosen]
    calibrations = recorded["calibrations"] if args.recorded_calibrations else {}
    flags = ["--repredict", args.repredict, *(["--recorded-calibrations"] if args.recorded_calibrations else []),
             *(["--target-accuracy", f"{args.target_accuracy:g}"] if args.target_accuracy is not None else []),
             *(["--across-hosts"] if args.across_hosts else []),
             *(["--calibrate-each"] if args.calibrate_each else [])]  # fmt: skip
    document = {**recorded, "settings": settings, "calibrations": calibrations, "real_runs_from": " ".join(flags)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for entry in document["settings"]:
            setting = tuple(entry["setting"])
            own = setting_calibration(entry, folder) if args.recorded_calibrations else None
            if args.calibrate_each:  # measured now, for this setting alone
                own = calibrate(setting[0], folder / f"calibration-{entry['number']}.json", args.across_hosts)
                entry["calibration"] = json.loads(own.read_text())
            elif own is None:  # predicted with the calibration measured now
                entry.pop("calibration", None)
            calibration = own or calibrated(setting[0], document, folder, args.across_hosts)
            prediction = predict(setting, calibration, args, folder)
            entry["target"] = target_of(setting[0], args)
            runs = {row["candidate"]: [{**run, "seconds_to_target": seconds_to_recorded(run, entry["target"])}
                                       for run in row["passes"]] for row in entry["verdict"]["rows"]}  # fmt: skip
            entry.update(prediction=prediction, verdict=judge(prediction, runs))
            print(f"setting {entry['number']}: {prediction['recommendation']}", flush=True)
    report(document, out)


if __name__ == "__main__":
    main()
