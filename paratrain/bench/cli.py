"""``paratrain bench``: run benchmark suites side by side, write one JSON and one Markdown.

Each suite is a name -> function table entry; a function takes ``quick`` (short
settings, for a smoke run) and returns its settings, its results and a Markdown table.
Nothing heavy is imported until a suite runs: launch/cli.py builds the parser on every
``paratrain`` call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.config import _check_writable
from paratrain.console import console
from paratrain.errors import ConfigError


def _allreduce(quick: bool) -> dict[str, Any]:
    from paratrain.bench import allreduce  # deferred: a suite loads when it runs, not on every `paratrain` parser build

    settings = {"models": ["mlp"] if quick else ["mlp", "cifar_cnn"], "rounds": 3 if quick else 31}
    results = allreduce.measure(settings["models"], rounds=settings["rounds"])
    return {"settings": settings, "results": results, "markdown": allreduce.markdown(results)}


def _ps(quick: bool) -> dict[str, Any]:
    from paratrain.bench import ps  # deferred: a suite loads when it runs, not on every `paratrain` parser build

    settings = (
        {"models": ["mlp"], "workers": [2], "epochs": 1, "repeats": 1, "straggler_workers": 0, "factor": 2.0}
        if quick
        else {
            "models": ["mlp", "cifar_cnn"],
            "workers": [2, 3],
            "epochs": 4,
            "repeats": 3,
            "straggler_workers": 4,
            "factor": 2.0,
        }
    )
    scaling = ps.scaling(settings["models"], settings["workers"], settings["epochs"], settings["repeats"])
    straggler = (
        ps.straggler(settings["straggler_workers"], settings["factor"], settings["epochs"], settings["repeats"])
        if settings["straggler_workers"]
        else []
    )
    return {
        "settings": settings,
        "results": {"scaling": scaling, "straggler": straggler},
        "markdown": ps.markdown(scaling, straggler, settings["straggler_workers"], settings["factor"]),
    }


def _codecs(quick: bool) -> dict[str, Any]:
    from paratrain.bench import codecs  # deferred: a suite loads when it runs, not on every `paratrain` parser build

    settings = (
        {"models": ["mlp"], "codecs": ["none", "fp16", "int8", "topk"], "workers": 2, "epochs": 1}
        if quick
        else {"models": list(codecs.MODELS), "codecs": list(codecs.CODECS), "workers": 2, "epochs": 3}
    )
    rows = codecs.measure(settings["models"], settings["codecs"], settings["workers"], settings["epochs"])
    targets = codecs.check_targets(rows)
    text = codecs.table(rows) + "\n\n" + "".join(f"- {line}\n" for line in targets)
    return {"settings": settings, "results": {"rows": rows, "targets": targets}, "markdown": text}


def _pipeline(quick: bool) -> dict[str, Any]:
    from paratrain.bench import pipeline  # deferred: imports torch.distributed.pipelining (sympy, seconds)

    settings = {
        "stages": 2,
        "microbatches": [1, 2, 4] if quick else [1, 2, 4, 8],
        "steps": 3 if quick else 20,
        "repeats": 1 if quick else 5,
        "layers": 8,
        "width": 256 if quick else 1024,
        "batch": 64 if quick else 256,
    }
    document = pipeline.run(
        settings["stages"],
        tuple(settings["microbatches"]),
        settings["steps"],
        settings["repeats"],
        settings["layers"],
        settings["width"],
        settings["batch"],
    )
    return {"settings": settings, "results": document, "markdown": pipeline.table(document["rows"], document["meta"])}


def _overhead(quick: bool) -> dict[str, Any]:
    from paratrain.bench import overhead  # deferred: a suite loads when it runs, not on every `paratrain` parser build

    settings = (
        {"models": ["mlp"], "rounds": 3, "repeats": 1, "epochs": 2, "batch_size": 32}
        if quick
        else {"models": ["mlp", "cifar_cnn"], "rounds": 11, "repeats": 3, "epochs": 4, "batch_size": 32}
    )
    rows = overhead.measure(
        settings["models"], settings["rounds"], settings["repeats"], settings["epochs"], settings["batch_size"]
    )
    return {"settings": settings, "results": rows, "markdown": overhead.markdown(rows, settings)}


SUITES: dict[str, tuple[str, Callable[[bool], dict[str, Any]]]] = {
    "allreduce": ("paratrain allreduce vs a raw DDP loop, ms per step", _allreduce),
    "ps": ("parameter-server modes vs allreduce, examples/s", _ps),
    "codecs": ("gradient codecs with allreduce: bytes/step, step time, accuracy", _codecs),
    "pipeline": ("GPipe vs 1F1B: bubble and activation memory", _pipeline),
    "overhead": ("each mode's per-step cost against the PyTorch loop (or the mode) it replaces", _overhead),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suites", default=",".join(SUITES), help=f"comma-separated, from {', '.join(SUITES)} (default all)"
    )
    p.add_argument("--quick", action="store_true", help="short settings: one small model, few rounds (a smoke run)")
    p.add_argument("--out", metavar="DIR", help="write DIR/bench.json and DIR/bench.md (DIR made if absent)")
    p.add_argument("--json-out", metavar="FILE.json", help="write the results as one JSON object")
    p.add_argument("--md-out", metavar="FILE.md", help="write the Markdown tables")
    p.set_defaults(handler=bench_command)


def check_arguments(args: argparse.Namespace) -> tuple[list[str], Path | None, Path | None]:
    """The suites to run and the two output files; ConfigError before anything runs."""
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown or not suites:
        raise ConfigError(f"--suites must be one or more of {', '.join(SUITES)}, comma-separated; got {args.suites!r}")
    json_out = Path(args.json_out) if args.json_out else None
    md_out = Path(args.md_out) if args.md_out else None
    if args.out:
        folder = Path(args.out)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {args.out} is a file; give a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"--out {args.out}: cannot make the folder ({error.strerror})") from None
        json_out, md_out = json_out or folder / "bench.json", md_out or folder / "bench.md"
    for name, path in (("json_out", json_out), ("md_out", md_out)):
        if path is not None:
            _check_writable(name, str(path))
    return suites, json_out, md_out


def bench_command(args: argparse.Namespace) -> int:
    suites, json_out, md_out = check_arguments(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    document: dict[str, Any] = {
        "command": f"paratrain bench --suites {','.join(suites)}{' --quick' if args.quick else ''}",
        "quick": args.quick,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "suites": {},
    }
    sections = [f"# paratrain bench{' --quick' if args.quick else ''}", ""]
    for name in suites:
        title, run = SUITES[name]
        console.print(f"bench: {name} ({title}) ...")
        start = time.perf_counter()
        outcome = run(args.quick)
        seconds = time.perf_counter() - start
        document["suites"][name] = {
            "title": title,
            "seconds": seconds,
            "settings": outcome["settings"],
            "results": outcome["results"],
        }
        sections += [f"## {name}: {title}", "", outcome["markdown"].rstrip(), ""]
        console.print(f"bench: {name} done in {seconds:.0f} s")
    markdown = "\n".join(sections)
    if json_out:
        json_out.write_text(json.dumps(document, indent=2) + "\n")
    if md_out:
        md_out.write_text(markdown)
    print(markdown)
    return 0
