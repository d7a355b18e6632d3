"""The user's path through the simulator, checked on emulated clusters: calibrate on this
machine, ask ``paratrain simulate --recommend`` about a cluster, then run every strategy it
ranked on that cluster for real.

For each model, once: ``paratrain simulate --calibrate FILE --model M`` on this machine's
whole cores (no number given by hand). For each setting (hosts, CPU share, link, one slow
host or none; the mlp on digits and cifar_cnn on cluster_common.digits32):

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

Writes benchmarks/results/simulator_recommend.json (its small form, recommend_report.recorded_form)
and .md after every setting (a run cut
short keeps the settings it finished; ``--only`` runs some again into the same file). The
settings, the verdicts and the report are recommend_report.py's; this file runs them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cluster_common import RESULTS, cluster_train, paratrain
from recommend_report import (
    BATCH,
    MODELS,
    RECORDED_TARGETS,
    SETTINGS,
    combine,
    judge,
    report,
    retimed,
    seconds_to_recorded,
    setting_words,
)

from paratrain.cpu_steal import cpu_times, stolen_share


def hosts_flags(hosts: int, cpu: float, link: str, slow: float) -> list[str]:
    flags = ["--hosts", str(hosts), "--cpu", f"{cpu:g}", "--link", link]
    return flags + (["--host", f"{hosts - 1}:cpu={cpu * slow:g}"] if slow < 1 else [])


def model_flags(model: str) -> list[str]:
    """The model, its data, the batch and the optimizer: what the calibration, the prediction and
    the real runs share."""
    return [
        "--model",
        model,
        "--dataset",
        MODELS[model]["dataset"],
        "--batch-size",
        str(BATCH),
        *MODELS[model]["optimizer"],
    ]


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
        "simulate",
        "--recommend",
        *hosts_flags(hosts, cpu, link, slow),
        "--calibration",
        str(calibration),
        *model_flags(model),
        "--target-accuracy",
        str(target_of(model, args)),
        "--epochs",
        str(epochs_of(model, args)),
        "--json-out",
        str(out),
    )
    prediction = json.loads(out.read_text())
    prediction["seconds_to_predict"] = time.perf_counter() - started
    prediction["said"] = result.stdout.strip().splitlines()
    return prediction


def real_run(setting: tuple, candidate: dict, args: argparse.Namespace, folder: Path, seed: int) -> dict:
    model, hosts, cpu, link, slow = setting
    train = [
        *train_flags(candidate),
        *model_flags(model),
        "--epochs",
        str(epochs_of(model, args)),
        "--seed",
        str(seed),
        "--timeout",
        "600",
    ]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--throttle-from",
        default="start",
        choices=("start", "training"),
        help="when the real runs' hosts begin at their CPU shares (paratrain cluster run --throttle-from; training: "
        "start-up at the machine's speed)",
    )
    parser.add_argument("--only", help="comma-separated setting numbers (1-based) to run, into the same file")
    parser.add_argument("--out", default=str(RESULTS / "simulator_recommend"))
    parser.add_argument("--target-accuracy", type=float, help="instead of each model's target (MODELS)")
    parser.add_argument(
        "--epochs",
        type=model_epochs,
        metavar="MODEL=N[,MODEL=N]",
        help="instead of these models' epochs (MODELS): longer real runs",
    )
    parser.add_argument("--across-hosts", action="store_true", help="calibrate with --across-hosts")
    parser.add_argument(
        "--calibrate-each",
        action="store_true",
        help="calibrate again before every setting, for its prediction (recorded with the setting)",
    )
    parser.add_argument(
        "--recorded-calibrations",
        action="store_true",
        help="with --repredict: the calibrations recorded beside the real runs, not measured again",
    )
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
                    print(
                        f"  pass {repeat + 1} {candidate['candidate']:32} {run['examples_per_second']:8,.0f} "
                        f"examples/s, to target {run['seconds_to_target']}",
                        flush=True,
                    )
            entry = {
                "number": number,
                "setting": list(setting),
                "prediction": prediction,
                "target": target_of(setting[0], args),
                "verdict": judge(prediction, runs),
                "seeds": list(range(args.repeats)),
                "optimizer": MODELS[setting[0]]["optimizer"],
            }
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
    flags = [
        "--repredict",
        args.repredict,
        *(["--recorded-calibrations"] if args.recorded_calibrations else []),
        *(["--target-accuracy", f"{args.target_accuracy:g}"] if args.target_accuracy is not None else []),
        *(["--across-hosts"] if args.across_hosts else []),
        *(["--calibrate-each"] if args.calibrate_each else []),
    ]
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
            recorded_target = entry.get("target", RECORDED_TARGETS[setting[0]])
            entry["target"] = target_of(setting[0], args)
            runs = {
                row["candidate"]: [
                    {**run, "seconds_to_target": retimed(run, recorded_target, entry["target"])}
                    for run in row["passes"]
                ]
                for row in entry["verdict"]["rows"]
            }
            entry.update(prediction=prediction, verdict=judge(prediction, runs))
            print(f"setting {entry['number']}: {prediction['recommendation']}", flush=True)
    report(document, out)


if __name__ == "__main__":
    main()
