"""Fault tolerance against restarts from checkpoints, both kept against one run: the plain
strategy undisturbed, with neither checkpoints nor fault tolerance (the run of a user who
meets no fault), so that what each way of surviving a loss costs when nothing fails (the
restarts' checkpoints, the quorums of ``--fault-tolerant``) counts against it.

    python benchmarks/ft_versus.py --strategy local-sgd [--model cifar_cnn] [--every 30 --kills 9]
        [--minutes 4.75] [--sets 1] [--add] [--out benchmarks/results/ft_versus_local_sgd]

A set of runs: the plain run, then for each interval between kills (``--every 30,10
--kills 9,27``) ``X-ft`` and ``X (restart)`` killed from outside every so many seconds (a
random replica process, the same choices in both: ft_recovery.kill_repeatedly), every second set in the
reverse order (counted over the record's sets with ``--add``, so that sets added on other
days alternate too). Kept: the plain run's seconds over a disturbed run's, whole commands,
the same epochs (sized by ``--minutes`` on the plain run, as ft_recovery.py's ``--minutes``).
Ahead: per set, the restarts' seconds over the fault-tolerant run's, the two killed alike;
above 100% the fault-tolerant run did the same work sooner. The runs and their tables are
ft_recovery.py's; ``--add`` joins the sets recorded before in ``--out`` with the same model,
strategy and settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402
from ft_recovery import (  # noqa: E402
    MODELS,
    STRATEGIES,
    intervals_of,
    pair,
    processor_lines,
    row_of,
    sized,
    throughput_line,
    train,
)
from recorded_table import cpu_name  # noqa: E402

#: What a set of runs must share with the sets recorded before for ``--add``.
SETTINGS = ("model", "strategy", "every", "kills", "minutes")


def names(strategy: str) -> tuple[str, str, str]:
    """The plain run's, the fault-tolerant run's and the restarts' names in ft_recovery.py."""
    return f"{strategy} (plain)", f"{strategy}-ft", f"{strategy} (restart)"


def one_set(model: str, strategy: str, intervals: list[tuple[float, int]], longer: int, backwards: bool) -> list[dict]:
    """The plain run and, per interval, the fault-tolerant run and the restarts killed alike:
    a pair (the plain run, a disturbed one) per disturbed run, in the order of ``names``."""
    plain, tolerant, restart = names(strategy)
    restarts = ["--max-restarts", str(max(k for _, k in intervals))]  # both disturbed commands alike
    order = [(plain, 0.0, 0), *((name, every, kills) for every, kills in intervals for name in (tolerant, restart))]
    runs = {}
    for name, every, kills in order[::-1] if backwards else order:
        extra = [] if name == plain else restarts
        with tempfile.TemporaryDirectory() as tmp:
            runs[name, every] = train(model, name, extra, Path(tmp), kill_every=every, kills=kills, longer=longer)
        print(f"{name}: every {every:g} s: {runs[name, every]['seconds']:.1f} s", flush=True)
    here = cpu_name()
    return [
        pair(runs[plain, 0.0], runs[name, every])
        | {
            "strategy": name,
            "every": every,
            "kills": kills,
            "longer": longer,
            "processor": here,
            "disturbed_first": backwards,
        }
        for every, kills in intervals
        for name in (tolerant, restart)
    ]


def rows_of(model: str, pairs: list[dict]) -> list[dict]:
    """A row per strategy and interval: the medians of its pairs (in the order they ran)."""
    keys = list(dict.fromkeys((p["strategy"], p["every"], p["kills"]) for p in pairs))
    return [
        row_of(model, name, (every, kills), [p for p in pairs if (p["strategy"], p["every"]) == (name, every)])
        for name, every, kills in keys
    ]


def ahead(rows: list[dict], strategy: str, every: float) -> list[float]:
    """Per set, the restarts' seconds over the fault-tolerant run's, killed every ``every`` s."""
    _, tolerant, restart = names(strategy)
    runs = {r["strategy"]: r["runs"] for r in rows if r["every"] == every}
    return [b["disturbed_seconds"] / a["disturbed_seconds"] for a, b in zip(runs[tolerant], runs[restart], strict=True)]


def tables(document: dict) -> list[str]:
    """A table per interval (the longest first): the two rows kept against the plain run, and
    how far the fault-tolerant run was ahead of the restarts."""
    strategy, model = document["strategy"], document["model"]
    plain, tolerant, restart = names(strategy)
    lines = [
        f"# `{tolerant}` against `{restart}`, both kept against `{plain}` undisturbed",
        "",
        f"`{plain}`: `{restart}`'s command without checkpoints (`{' '.join(STRATEGIES[restart])}`, "
        f"{model}; the restarts' checkpoints every {MODELS[model][3]} steps). Runs of about "
        f"{document['minutes']:g} minutes undisturbed.",
    ]
    for every, kills in sorted(zip(document["every"], document["kills"], strict=True), reverse=True):
        ratios = ahead(document["rows"], strategy, every)
        spread = f" ({min(ratios):.0%}-{max(ratios):.0%})" if len(ratios) > 1 else ""
        lines += [
            "",
            f"## A random replica process killed every {every:g} s, {kills} times",
            "",
            "| model | strategy | runs | undisturbed s (plain) | disturbed s | kept | losses | a loss costs (s) "
            "| test accuracy (plain) | stolen (plain / disturbed) | steps/s (plain / disturbed) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
            *(throughput_line(r) for r in document["rows"] if r["every"] == every),
            "",
            f"`{tolerant}` ahead of `{restart}` (the restarts' seconds over its own, per set): "
            f"{statistics.median(ratios):.0%}{spread} over {len(ratios)} sets.",
        ]
    lines += processor_lines(document["rows"], document["every"][0])
    lines += [
        "",
        "Each set: the plain run and one run of each disturbed row, every second set in the reverse "
        "order. Kept: the plain run's seconds over the disturbed run's (the medians over the sets); "
        "the columns are ft_recovery.py's.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = sorted({name.removesuffix(" (restart)") for name in STRATEGIES if name.endswith(" (restart)")})
    parser.add_argument("--strategy", required=True, choices=choices)
    parser.add_argument("--model", default="cifar_cnn", choices=sorted(MODELS))
    parser.add_argument("--every", default="30", help="seconds between kills; several, comma-separated (30,10)")
    parser.add_argument("--kills", default="9", help="kills per disturbed run, one count per --every")
    parser.add_argument("--minutes", type=float, default=4.75, help="the plain run's length on today's speed")
    parser.add_argument("--sets", type=int, default=1, help="sets of runs (each: the plain run and the disturbed ones)")
    parser.add_argument("--add", action="store_true", help="the sets join those recorded in --out (same settings)")
    parser.add_argument("--out", default=None, help="results' path less its suffix (default: results/ft_versus_S)")
    args = parser.parse_args()
    intervals = intervals_of(parser, args.every, args.kills)
    if not args.minutes > 0 or args.sets < 1:
        parser.error(f"--minutes must be > 0 and --sets >= 1, got {args.minutes:g} and {args.sets}")
    out = Path(args.out or RESULTS / f"ft_versus_{args.strategy.replace('-', '_')}")
    document = {
        "model": args.model,
        "strategy": args.strategy,
        "every": [e for e, _ in intervals],
        "kills": [k for _, k in intervals],
        "minutes": args.minutes,
    }
    path = out.with_suffix(".json")
    earlier = json.loads(path.read_text()) if args.add and path.exists() else None
    if earlier and any(earlier[key] != document[key] for key in SETTINGS):
        parser.error(f"--add: {path} holds other settings: " + ", ".join(f"{key} {earlier[key]}" for key in SETTINGS))
    pairs = [p for row in earlier["rows"] for p in row["runs"]] if earlier else []
    recorded = len(pairs) // (2 * len(intervals))
    longer = sized(args.model, names(args.strategy)[0], args.minutes, None)
    for index in range(args.sets):
        pairs += one_set(args.model, args.strategy, intervals, longer, (recorded + index) % 2 == 1)
        done = {**document, "rows": rows_of(args.model, pairs)}
        record(out, done, tables(done))  # after every set: a stopped command keeps the sets it ran


if __name__ == "__main__":
    main()
