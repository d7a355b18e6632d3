import atexit
import functools
import importlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def hosts_missing() -> str | None:
    """Why emulated hosts (paratrain cluster) cannot start here, in one line, or None (asked
    of the machine once a test process)."""
    from paratrain.cluster.hosts import check_support
    from paratrain.errors import ConfigError

    try:
        check_support()
    except ConfigError as error:
        return str(error)
    return None


#: A test that runs on emulated hosts: skipped, with the reason, where they cannot start.
needs_hosts = pytest.mark.skipif(hosts_missing() is not None, reason=str(hosts_missing()))

# Distributed tests run Gloo on loopback with one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PARATRAIN_THREADS_PER_WORKER", "1")  # tests run side by side (pytest -n)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The processes of each pytest worker list themselves among the machine's paratrain processes
# (launch/host_share.py) in a folder of the worker's own: a test of the default threads sees
# its own run's processes, not those of the tests beside it.
if "PARATRAIN_HOST_REGISTRY" not in os.environ:
    os.environ["PARATRAIN_HOST_REGISTRY"] = tempfile.mkdtemp(prefix="paratrain-registry-")
    atexit.register(shutil.rmtree, os.environ["PARATRAIN_HOST_REGISTRY"], True)
# Tests run in several pytest-xdist workers (at most 6): each takes its rendezvous ports
# from a range of its own, below the kernel's ephemeral ports (32768 and up), so that
# neither another test's run nor any process's outgoing connection takes a port between its
# pick and its bind. The jobs of a test's local SLURM inherit it and derive their port in it:
# two workers' SLURMs both number their jobs from 1.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_INDEX = int(_WORKER[2:]) if _WORKER[2:].isdigit() else 0
os.environ.setdefault("PARATRAIN_PORT_RANGE", f"{20000 + 2000 * _INDEX}-{21999 + 2000 * _INDEX}")


#: The composition matrix: a case marked ``matrix`` shows for one more strategy or layout
#: what another case of the suite shows already. The suite runs each parallelism alone and
#: each pair once; ``PARATRAIN_MATRIX=full`` runs every case (benchmarks/matrix.py records it).
FULL_MATRIX = os.environ.get("PARATRAIN_MATRIX") == "full"


def pytest_collection_modifyitems(config, items):
    """Leave the ``matrix`` cases to the full matrix (``PARATRAIN_MATRIX=full``)."""
    if FULL_MATRIX:
        return
    matrix = [item for item in items if item.get_closest_marker("matrix") is not None]
    if matrix:
        config.hook.pytest_deselected(items=matrix)
        items[:] = [item for item in items if item.get_closest_marker("matrix") is None]


#: Variables that make ``paratrain train`` join a cluster (torchrun's, TF_CONFIG, a
#: fault-tolerant replica's) instead of starting processes: such a command runs in a process
#: of its own, as the cluster's other members do.
CLUSTER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "TF_CONFIG",
    "SLURM_PROCID",
    "REPLICA_GROUP_ID",
    "TORCHFT_LIGHTHOUSE",
)

#: Variables a process reads once, before a command could set them (urllib builds its proxy
#: handler at its first request): a command given one runs in a fresh interpreter too.
READ_ONCE_VARS = ("http_proxy", "https_proxy", "no_proxy", "OMP_NUM_THREADS")

#: The libraries whose models the tests train in a run's processes (a transformers GPT-2, a
#: datasets.Dataset), imported once by each pytest worker's fork server, which paratrain
#: makes import torch and paratrain (launch/process.py): importing transformers' GPT-2 costs
#: a fresh process ~5 s of CPU, and about twenty processes of the suite's runs build one.
#: A library that is not installed is left out (the fork server skips what it cannot import).
PRELOAD_FOR_TESTS = ["transformers.models.gpt2.modeling_gpt2", "datasets"]

#: ``PARATRAIN_TEST_CLI=subprocess`` runs every ``run_cli`` command in a fresh interpreter.
_SUBPROCESS = os.environ.get("PARATRAIN_TEST_CLI") == "subprocess"
if not _SUBPROCESS:
    from paratrain.launch import process as _process

    _process.PRELOAD.extend(name for name in PRELOAD_FOR_TESTS if name not in _process.PRELOAD)


def torchrun_on_loopback(processes: int, *target: str) -> list[str]:
    """The command that starts ``processes`` processes of ``target`` (a script and its
    arguments, or ``-m`` and a module's) under torchrun, as one node on loopback at a free port."""
    from paratrain.comm.transport import free_port

    return [
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
        *target,
    ]


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``paratrain ARGS``; returns the finished command (exit code, standard output and error).

    The command runs in this test process, as ``paratrain`` would in a shell of its own: its
    arguments, the environment with ``env`` over it, ``cwd``, its standard output and error
    captured at the file descriptors (the lines its processes write included). The processes
    of a run start from this process's fork server, which imported torch and paratrain once
    for the whole session instead of once a command (~8 s of CPU each). A command that joins
    a cluster or sets a variable read once (``CLUSTER_VARS``, ``READ_ONCE_VARS``) runs in a
    fresh interpreter, as does every command under ``PARATRAIN_TEST_CLI=subprocess``. A
    ``PYTHONPATH`` in ``env`` is put in front of ``sys.path`` for the command (and its
    processes), and what was imported from it (or from ``cwd``) is forgotten after."""
    if _fresh(env):
        return subprocess.run(
            [sys.executable, "-m", "paratrain", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            cwd=cwd or REPO,
        )
    from paratrain.launch.cli import main

    return _run_here(["paratrain", *args], lambda: main(list(args)), env or {}, cwd or REPO)


def run_script(
    script: Path, *args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS``, as ``run_cli`` runs a command: in this test process (the script
    run as ``__main__``, with its own ``sys.argv``, its folder first on ``sys.path``), or in a
    fresh interpreter where ``run_cli`` would use one."""
    if _fresh(env):
        return subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            cwd=cwd or REPO,
        )

    def call() -> None:
        saved_argv = sys.argv
        sys.argv = [str(script), *args]
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = saved_argv

    env = {
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(script).parent), (env or {}).get("PYTHONPATH")])),
    }
    return _run_here([sys.executable, str(script), *args], call, env, cwd or REPO)


def _fresh(env: dict | None) -> bool:
    return _SUBPROCESS or any(name in (env or {}) for name in CLUSTER_VARS + READ_ONCE_VARS)


def _run_here(argv: list[str], call, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    import torch  # after the thread settings above

    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_path = list(sys.path)
    saved_modules, saved_threads = set(sys.modules), torch.get_num_threads()
    added = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:0] = added
    dropped = [*added, *([str(cwd)] if Path(cwd).resolve() != REPO else [])]
    importlib.invalidate_caches()
    saved_streams = sys.stdout, sys.stderr
    saved_fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = io.TextIOWrapper(open(os.dup(1), "wb"), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(os.dup(2), "wb"), encoding="utf-8", line_buffering=True)
        os.environ.update(env)
        os.chdir(cwd)
        try:
            code = call() or 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except Exception:  # what a fresh interpreter prints, and its exit code (a test's
            # timeout and Ctrl-C, BaseExceptions, still end the test)
            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
                stream.close()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.path[:] = saved_path
            torch.set_num_threads(saved_threads)
            for name in set(sys.modules) - saved_modules:  # a user's model module, by its path
                where = getattr(sys.modules[name], "__file__", None) or ""
                if any(where.startswith(entry) for entry in dropped):
                    del sys.modules[name]
        texts = []
        for handle in (out, err):
            handle.seek(0)
            texts.append(handle.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(argv, code, *texts)


@pytest.fixture
def cli():
    return run_cli


def as_formed(spans: list[list[int]], replicas: int) -> list[list[int]]:
    """A fault-tolerant run's participants per step (``[first, last, P]`` spans), read as if
    every replica was in the first quorum. A replica that the machine's load keeps from its
    heartbeat for longer than --replica-heartbeat-timeout while the group forms misses the
    first quorum and takes a peer's state at the next (under allreduce, fsdp and pipeline the
    run is the same: every step takes the whole global batch; not under local-sgd or diloco,
    where the missed round's local steps count for nothing); that is allowed for the first
    2 steps, never later."""
    if len(spans) > 1 and spans[0][0] == 1 and spans[0][1] <= 2 and spans[0][2] < replicas == spans[1][2]:
        return [[1, spans[1][1], replicas], *spans[2:]]
    return spans


def single_run(folder: Path, run: list[str], global_batch: int) -> dict:
    """The metrics of ``single`` over ``run`` (flags without a batch size) with the global batch."""
    out = folder / "single.json"
    result = run_cli("train", *run, "--batch-size", str(global_batch), "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def assert_same_run(metrics: dict, reference: dict, rel: float = 1e-4) -> None:
    """A fault-tolerant run whose every committed step took the whole global batch, whoever
    was alive, is the single-process run up to the order of float sums: ``rel`` on every
    epoch's losses, the same steps, the accuracy within a point."""
    assert metrics["global_steps"] == reference["global_steps"]
    for epoch, (mine, theirs) in enumerate(zip(metrics["history"], reference["history"], strict=True)):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=rel), epoch
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=rel), epoch
    assert abs(metrics["test_accuracy"] - reference["test_accuracy"]) <= 0.01


def replaced_replica_run(flags: list[str], out: Path, process: int, lost: str) -> dict:
    """A local fault-tolerant run of ``flags`` (2 replicas of 2 processes, one restart) whose
    ``process``-th process (in start order: replica 0's, then replica 1's) is killed from
    outside once the step log passes step 30. Its metrics, once checked: it exited 0, named
    the lost process (``lost``, as the launcher names it), both processes of a whole new
    replica took the live state, and no process restarted; the participants went 2 -> 1 -> 2,
    or stayed 2 where the new replica was in the quorum before the survivor stepped alone."""
    import re
    import signal

    from paratrain.testing import run_processes

    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        *flags,
        "--progress",
        "--log-every",
        "10",
        "--max-restarts",
        "1",
        "--metrics-out",
        str(out),
    ]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in run.stdout:
            if line.startswith("step ") and int(line.split()[1].rstrip(",")) >= 30:
                break
        processes = run_processes(run.pid)
        assert len(processes) == 4, processes
        os.kill(processes[process], signal.SIGKILL)
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(
        rf"paratrain: {lost} was lost \(killed by SIGKILL\) after step \d+; a replacement "
        r"joins the run \(restart 1 of 1\)",
        stderr,
    ), stderr[-3000:]
    assert len(re.findall(r"paratrain: worker \d joined the run at step \d+ with a live peer's state", stderr)) == 2
    metrics = json.loads(out.read_text())
    counts = [span[2] for span in as_formed(metrics["participants"]["per_step"], 2)]
    assert counts[0] == 2 and counts[-1] == 2 and set(counts) <= {1, 2}, metrics["participants"]
    assert metrics["restarts"] == 0
    return metrics


def power_cut_run(flags: list[str], folder: Path, parts: list[str], steps: int, lowest: int = 40) -> dict:
    """A local fault-tolerant run of ``flags`` whose every process dies after step 50, with a
    checkpoint every 20 steps into ``folder`` (4 restarts: a replacement that fails to start
    under load gets another). Its metrics, once checked: it exited 0, resumed from step
    ``lowest`` or a later checkpoint, committed every one of its ``steps`` once, and each
    checkpoint holds ``parts``."""
    out = folder.parent / "m.json"
    cut = ["--checkpoint-dir", str(folder), "--checkpoint-every", "20", "--max-restarts", "4", "--fail", "all@50"]
    result = run_cli("train", *flags, *cut, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    resumed = metrics["resumed_from_step"]
    assert metrics["restarts"] >= 1 and resumed >= lowest and resumed % 20 == 0, metrics["participants"]
    segments = as_formed(metrics["participants"]["per_step"], 2)
    assert segments[0][0] == 1 and segments[-1][1] == steps
    assert all(a[1] + 1 == b[0] for a, b in zip(segments, segments[1:])), segments  # every step once
    manifests = [json.loads((d / "manifest.json").read_text()) for d in sorted(folder.glob("ckpt-*"))]
    assert manifests and all(sorted(m["parts"]) == parts for m in manifests)
    return metrics


def needs_torch(release: tuple[int, int], what: str):
    """Skips a test on a PyTorch older than ``release`` (paratrain refuses ``what`` there:
    paratrain/versions.py)."""
    from paratrain.versions import torch_release

    wanted = f"{release[0]}.{release[1]}"
    return pytest.mark.skipif(torch_release() < release, reason=f"{what} needs PyTorch {wanted} or newer")


PACKED_TP = needs_torch((2, 12), "tensor parallelism of packed projections")
SEQUENCE_PACKED_TP = needs_torch((2, 13), "tensor parallelism of packed projections with --sequence-parallel")
TRACED_PIPELINE = needs_torch((2, 13), "a pipeline of a traced model")
