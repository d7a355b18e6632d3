"""Fault drills: each fault, in each mode it applies to, through the ``paratrain`` CLI.

Every drill runs a real multi-process run (Gloo on loopback) with a fault injected
(``--fail`` kills a worker or a parameter-server shard with SIGKILL, ``--hang`` makes
a worker stop answering), or
damages the checkpoints a run resumes from, and records what happened: the exit code,
the last line on stderr, the test accuracy, and what was lost. The table lands in
``benchmarks/results/reliability.md`` (and ``.json``).

    python benchmarks/reliability_drills.py            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUN = ["--workers", "2", "--epochs", "10", "--no-progress", "--log-every", "0", "--checkpoint-every", "20"]
MODES = {
    "allreduce": ["--strategy", "allreduce"],
    "ps-sync": ["--strategy", "ps-sync"],
    "ps-backup": ["--strategy", "ps-backup", "--backup-workers", "1"],
    "ps-async": ["--strategy", "ps-async"],
}
RESTARTS = {"allreduce": ["--max-restarts", "1"], "ps-sync": ["--max-restarts", "1"]}


def paratrain(*args: str, limit_file_size: int | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"

        def limits() -> None:
            if limit_file_size:  # writes past it fail (EFBIG), as on a full disk
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        result = subprocess.run(
            [sys.executable, "-m", "paratrain", "train", *args, "--metrics-out", str(out)],
            capture_output=True,
            text=True,
            env=env,
            preexec_fn=limits,
            timeout=600,
        )
        metrics = json.loads(out.read_text()) if out.exists() else None
    return result, metrics


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("paratrain:")]
    return lines[-1] if lines else ""


def row(fault: str, mode: str, result: subprocess.CompletedProcess, metrics: dict | None, lost: str) -> dict:
    accuracy = f"{metrics['test_accuracy']:.3f}" if metrics else "-"
    said = re.sub(r"/tmp/[^ ]*?/(?=ckpt)", "D/", last_line(result)) or "-"
    return {"fault": fault, "mode": mode, "exit": result.returncode, "accuracy": accuracy, "said": said, "lost": lost}


def kill_drills(rng: random.Random, work: Path) -> list[dict]:
    rows = []
    for mode, flags in MODES.items():
        step = rng.randint(25, 200)
        folder = work / f"kill-{mode}"
        result, metrics = paratrain(
            *flags,
            *RUN,
            "--fail",
            f"1@{step}",
            "--checkpoint-dir",
            str(folder),
            "--heartbeat-timeout",
            "2",
            *RESTARTS.get(mode, []),
        )
        rows.append(row(f"kill -9 worker 1 at step {step}", mode, result, metrics, lost_by(result, metrics)))
    return rows


def shard_drills(rng: random.Random, work: Path) -> list[dict]:
    """A parameter-server shard killed: fatal in every mode (it holds the only copy of its
    parameters), so the run restarts from the last checkpoint."""
    rows = []
    for mode in ("ps-sync", "ps-backup", "ps-async"):
        version = rng.randint(25, 200)
        result, metrics = paratrain(
            *MODES[mode],
            *RUN,
            "--fail",
            f"ps:0@{version}",
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(work / f"shard-{mode}"),
        )
        rows.append(row(f"kill -9 ps shard 0 at version {version}", mode, result, metrics, lost_by(result, metrics)))
    return rows


def lost_by(result: subprocess.CompletedProcess, metrics: dict | None) -> str:
    redone = re.search(r"(\d+) steps redone", result.stderr)
    if redone:
        return f"{redone.group(1)} steps redone after 1 restart"
    if metrics and metrics.get("workers_lost"):
        dropped = metrics["dropped_gradients"]
        late = f"; {dropped} late gradients dropped by the backup rule, as always" if dropped else ""
        return f"worker 1's gradient in flight; the others took its remaining batches{late}"
    if metrics:
        return "nothing: the run finished without it"
    return "the run"


def hang_drills(work: Path) -> list[dict]:
    rows = []
    for mode, flags in MODES.items():
        result, metrics = paratrain(
            *flags,
            *RUN,
            "--hang",
            "1@30",
            "--timeout",
            "6",
            "--heartbeat-timeout",
            "2",
            "--checkpoint-dir",
            str(work / f"hang-{mode}"),
            *RESTARTS.get(mode, []),
        )
        rows.append(row("worker 1 hangs at step 30 (--timeout 6)", mode, result, metrics, lost_by(result, metrics)))
    return rows


def divergence_drills(work: Path) -> list[dict]:
    folder = work / "nan"
    stop, _ = paratrain(
        *MODES["allreduce"], *RUN, "--lr", "1e20", "--checkpoint-every", "1", "--checkpoint-dir", str(folder)
    )
    kept = sorted(p.name for p in folder.glob("ckpt-*")) if folder.exists() else []
    rows = [
        row(
            "loss becomes NaN (--lr 1e20)",
            "allreduce",
            stop,
            None,
            f"nothing diverged was saved (checkpoints kept: {', '.join(kept) or 'none'})",
        )
    ]
    return rows


def checkpoint_drills(work: Path) -> list[dict]:
    rows = []
    folder = work / "runs"
    paratrain(*MODES["allreduce"], *RUN[:3], "2", *RUN[4:], "--checkpoint-dir", str(folder))
    newest = sorted(folder.glob("ckpt-*"))[-1]
    before = sorted(p.name for p in folder.glob("ckpt-*"))
    # A checkpoint of another strategy.
    result, metrics = paratrain(*MODES["ps-sync"], *RUN, "--checkpoint-dir", str(folder), "--resume")
    rows.append(
        row(
            "--resume from another strategy's checkpoint",
            "ps-sync",
            result,
            metrics,
            "nothing: checkpoints untouched"
            if sorted(p.name for p in folder.glob("ckpt-*")) == before
            else "CHECKPOINTS CHANGED",
        )
    )
    # A full disk while saving.
    result, metrics = paratrain(
        *MODES["allreduce"], *RUN, "--checkpoint-dir", str(folder), "--resume", limit_file_size=100_000
    )
    rows.append(
        row(
            "disk full while saving (writes past 100 kB fail)",
            "allreduce",
            result,
            metrics,
            "the steps since the last checkpoint; earlier checkpoints kept",
        )
    )
    # A corrupt part in the newest checkpoint.
    part = newest / "rank-0.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    result, metrics = paratrain(*MODES["allreduce"], *RUN, "--checkpoint-dir", str(folder), "--resume")
    rows.append(
        row(
            "a byte flipped in the newest checkpoint, then --resume",
            "allreduce",
            result,
            metrics,
            "nothing deleted; the run refuses to start from it",
        )
    )
    return rows


def crash_mid_write_drill(work: Path) -> dict:
    folder = work / "crash"
    paratrain(*MODES["allreduce"], *RUN[:3], "1", *RUN[4:], "--checkpoint-dir", str(folder))
    script = (
        "import os, sys, torch\nimport paratrain.train.checkpoint as c\n"
        "def dying_fsync(fd):\n    os.ftruncate(fd, os.fstat(fd).st_size // 2)\n    os._exit(9)\n"
        "os.fsync = dying_fsync\nc.CheckpointStore(sys.argv[1]).write_part(99, 'rank-0', {'x': torch.zeros(10000)})\n"
    )
    subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True)
    result, metrics = paratrain(*MODES["allreduce"], *RUN, "--checkpoint-dir", str(folder), "--resume")
    resumed = metrics["resumed_from_step"] if metrics else None
    return row(
        "process killed half-way through writing a checkpoint, then --resume",
        "allreduce",
        result,
        metrics,
        f"the half-written part only; resumed from the previous checkpoint (step {resumed})",
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "| fault | mode | exit | test accuracy | what the run said (last line) | what was lost |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        said = r["said"].replace("|", "\\|")
        lines.append(f"| {r['fault']} | {r['mode']} | {r['exit']} | {r['accuracy']} | {said} | {r['lost']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill steps")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = kill_drills(rng, work) + shard_drills(rng, work) + hang_drills(work) + divergence_drills(work)
        rows += checkpoint_drills(work) + [crash_mid_write_drill(work)]
    table = markdown(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reliability.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "reliability.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
