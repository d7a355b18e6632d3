"""Exit stress: the README's first Python script, verbatim, under torchrun, many times over
every strategy; counts the runs whose processes did not all exit 0, and among them the
aborts at exit ("terminate called ...", SIGABRT) after training had finished.

    python benchmarks/exit_stress.py [--runs 28] [--strategies allreduce,fsdp] [--seed 0] [--more]

The per-step fault-tolerant strategies run as their docs say to run them under torchrun:
a Lighthouse (torchft's), and one torchrun job per replica with its REPLICA_GROUP_ID and
``--lighthouse``. Runs go in a seeded random order over the strategies, so a strategy's
runs meet different loads. Writes benchmarks/results/exit_stress.json and .md; ``--more`` adds the new runs to the
recorded ones (use another seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recorded_table import small_json

from paratrain.comm.transport import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUN_TIMEOUT_S = 180
ABORT = re.compile(r"terminate called|Aborted|SIGABRT|Signals\.SIGABRT|exitcode\s*:\s*-6")
# name -> (flags of the script, processes per torchrun job, torchrun jobs)
STRATEGIES: dict[str, tuple[list[str], int, int]] = {
    "single": (["--strategy", "single"], 1, 1),
    "allreduce": (["--strategy", "allreduce"], 2, 1),
    "allreduce-ft": (["--strategy", "allreduce-ft", "--workers", "2"], 1, 2),
    "ps-sync": (["--strategy", "ps-sync"], 3, 1),
    "ps-backup": (["--strategy", "ps-backup", "--backup-workers", "1"], 3, 1),
    "ps-async": (["--strategy", "ps-async"], 3, 1),
    "pipeline": (["--strategy", "pipeline", "--stages", "2"], 2, 1),
    "pipeline-ft": (["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4"], 2, 2),
    "local-sgd": (["--strategy", "local-sgd", "--sync-every", "4"], 2, 1),
    "diloco": (["--strategy", "diloco", "--sync-every", "4"], 2, 1),
    "fsdp": (["--strategy", "fsdp"], 2, 1),
}


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]


def torchrun(script: Path, flags: list[str], processes: int, env: dict[str, str]) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(processes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--local-addr",
        "127.0.0.1",
        str(script),
        *flags,
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def one_run(name: str, script: Path) -> dict:
    """One run of ``name``: every torchrun job's exit code, and whether any output shows an abort."""
    flags, processes, jobs = STRATEGIES[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    lighthouse = None
    if jobs > 1:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
        flags = [*flags, "--lighthouse", lighthouse.address()]
    start = time.perf_counter()
    try:
        running = [torchrun(script, flags, processes, {**env, "REPLICA_GROUP_ID": str(j)}) for j in range(jobs)]
        outputs, codes = [], []
        for process in running:
            try:
                out, _ = process.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            outputs.append(out)
            codes.append(process.returncode)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    text = "\n".join(outputs)
    reports = len(re.findall(r"\{'loss': [^}]*\}", text))
    return {
        "strategy": name,
        "codes": codes,
        "ok": all(code == 0 for code in codes),
        "abort": bool(ABORT.search(text)),
        "reports": reports,
        "seconds": round(time.perf_counter() - start, 2),
        "tail": "" if all(code == 0 for code in codes) else text[-2000:],
    }


def table(summary: dict) -> str:
    lines = ["| strategy | runs | not exit 0 | aborts at exit | median s |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, row in summary.items():
        lines.append(f"| `{name}` | {row['runs']} | {row['failed']} | {row['aborts']} | {row['median_s']:.1f} |")
    runs = sum(r["runs"] for r in summary.values())
    failed = sum(r["failed"] for r in summary.values())
    aborts = sum(r["aborts"] for r in summary.values())
    lines.append(f"| all | {runs} | {failed} | {aborts} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=28, help="runs per strategy")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; leave the recorded results")
    parser.add_argument("--more", action="store_true", help="add these runs to the recorded ones")
    args = parser.parse_args()
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; valid: {', '.join(STRATEGIES)}")
    order = [n for n in names for _ in range(args.runs)]
    random.Random(args.seed).shuffle(order)
    print(f"seed {args.seed}: {len(order)} runs", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "script.py"
        script.write_text(readme_script())
        for i, name in enumerate(order):
            result = one_run(name, script)
            runs.append(result)
            mark = "ok" if result["ok"] else ("ABORT" if result["abort"] else "FAILED")
            print(f"[{i + 1}/{len(order)}] {name}: {mark} {result['codes']} {result['seconds']} s", flush=True)
            if not result["ok"]:
                print(result["tail"], flush=True)
    seeds = [args.seed]
    if args.more:
        recorded = json.loads((RESULTS / "exit_stress.json").read_text())
        runs = recorded["runs"] + runs
        seeds = recorded["seeds"] + seeds
    summary = {}
    for name in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == name]
        if not mine:
            continue
        seconds = sorted(r["seconds"] for r in mine)
        summary[name] = {
            "runs": len(mine),
            "failed": sum(not r["ok"] for r in mine),
            "aborts": sum(r["abort"] for r in mine),
            "median_s": seconds[len(seconds) // 2],
        }
    text = table(summary)
    print(text)
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"seeds": seeds, "summary": summary, "runs": runs}
    (RESULTS / "exit_stress.json").write_text(small_json(record))
    (RESULTS / "exit_stress.md").write_text(
        f"# Exit stress\n\n`python benchmarks/exit_stress.py --runs N --seed S [--more]`, seeds {seeds}\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
