"""ft_recovery.py's throughput rows over sets of runs: a row per interval between kills from
the sets' pairs (medians, the pairs kept in ``runs``), the rows recorded before that stay or
that new sets join (``--add``), and a run's length sized to minutes on this machine's speed
of the day (``--minutes``), which drifts by up to 2x between days."""

from __future__ import annotations

import argparse
import statistics

#: The run that sizes a strategy's runs for ``--minutes``: this many times the model's epochs.
PROBE = 8
#: A pair's fields that say how it was run, not what it measured: never a row's median.
SETTINGS = ("every", "kills", "longer")


def intervals_of(parser: argparse.ArgumentParser, every: str, kills: str) -> list[tuple[float, int]]:
    """``--every 30,10 --kills 9,27`` as (seconds between kills, kills) per interval; one
    line and exit 2 (``parser.error``) where the counts differ."""
    seconds, counts = every.split(","), kills.split(",")
    if len(seconds) != len(counts):
        parser.error(f"--every {every} and --kills {kills}: give one kill count per interval")
    return list(zip(map(float, seconds), map(int, counts), strict=True))


def longer_for(minutes: float, seconds: float, training_seconds: float) -> int:
    """How many times the model's epochs make an undisturbed run of ``minutes``, from a run of
    ``PROBE`` times them that took ``seconds``, ``training_seconds`` of it in the training
    loop (the rest: starting the processes and the data, evaluation at the end)."""
    if training_seconds <= 0 or seconds < training_seconds:
        raise SystemExit(
            f"--minutes: the sizing run's times make no sense ({seconds:.1f} s, training {training_seconds:.1f} s)"
        )
    start = seconds - training_seconds
    return max(1, round((60 * minutes - start) * PROBE / training_seconds))


def row_of(model: str, strategy: str, interval: tuple[float, int], runs: list[dict]) -> dict:
    """The row of ``runs`` (pairs, each from a set of runs): the medians of their numbers."""
    numbers = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k not in SETTINGS]
    medians = {key: statistics.median(r[key] for r in runs) for key in numbers}
    return {
        "kind": "throughput",
        "model": model,
        "strategy": strategy,
        **medians,
        "every": interval[0],
        "kills": interval[1],
        "runs": runs,
    }


def settings(document: dict) -> tuple:
    """What a record's runs must share with new ones for their rows to stand in one file:
    the intervals and kills, and the length (minutes, else the epochs' multiple)."""
    minutes = document.get("minutes")
    return document.get("every"), document.get("kills"), minutes, None if minutes else document.get("longer", 3)


def merged(rows: list[dict], earlier: dict | None, now: dict, add: bool) -> list[dict]:
    """``rows`` with the rows of ``earlier`` (a record's document) of other models, strategies,
    kinds or intervals; with ``add``, a throughput row recorded before for the same model,
    strategy and interval takes in the new row's pairs (its medians made again), else the new
    row replaces it. A record of other settings (``settings``) is replaced whole, or refused
    with ``add`` (``check_add`` says so before any run)."""
    if earlier is None:
        return rows
    if settings(earlier) != settings(now):
        check_add(earlier, now, add)
        return rows

    single = earlier.get("every") if not isinstance(earlier.get("every"), list) else None

    def key(row: dict) -> tuple:  # a row recorded before rows carried their interval: the file's one
        return row["kind"], row["model"], row["strategy"], row.get("every", single)

    before = {key(r): r for r in earlier["rows"]}
    joined = []
    for row in rows:
        old = before.pop(key(row), None)
        if add and old is not None and row["kind"] == "throughput":
            row = row_of(row["model"], row["strategy"], (row["every"], row["kills"]), old["runs"] + row["runs"])
        joined.append(row)
    return list(before.values()) + joined


def check_add(earlier: dict | None, now: dict, add: bool) -> None:
    """``--add`` to a record of other settings (``settings``) stops with a line saying both."""
    if add and earlier is not None and settings(earlier) != settings(now):
        raise SystemExit(
            f"--add: the record's runs had --every {earlier.get('every')} --kills {earlier.get('kills')} "
            f"and {length_words(earlier)}, these {length_words(now)} with --every {now.get('every')} "
            f"--kills {now.get('kills')}: add with the same settings"
        )


def length_words(document: dict) -> str:
    """A record's run length, as its table headings say it."""
    if document.get("minutes"):
        return f"about {document['minutes']:g} minutes undisturbed"
    return f"{document.get('longer', 3)}x the model's epochs"
