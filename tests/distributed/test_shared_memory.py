"""allreduce's sum through shared memory (comm/shared_memory.py) for the processes of one
machine: the sums are those of the same terms in rank order, in pieces and in any dtype; a
run through it is Gloo's to the bit on 2 processes and single's on 3 (float32 rounding); a
process that never comes is named; processes that are not all on one machine keep Gloo."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.comm import shared_memory
from paratrain.comm.shared_memory import CHUNK_BYTES, SharedMemoryAllReduce
from paratrain.testing import run_distributed

pytestmark = pytest.mark.distributed


def _sums(numel, dtype):
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    group = SharedMemoryAllReduce.create(timeout=30)
    rank, size = dist.get_rank(), dist.get_world_size()
    terms = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(size)]
    expected = terms[0].clone()
    for term in terms[1:]:
        expected.add_(term)
    results = []
    for _ in range(3):  # the two sets of slots alternate: a third call reuses the first
        results.append(group.all_reduce_(terms[rank].clone()))
    return [bool(torch.equal(r, expected)) for r in results]


@pytest.mark.parametrize(
    ("numel", "dtype"),
    [(1, torch.float32), (1000, torch.float32), (CHUNK_BYTES // 4 * 2 + 3, torch.float32), (12345, torch.bfloat16)],
    ids=["one", "small", "three-pieces", "bf16"],
)
def test_every_process_gets_the_sum_in_rank_order(numel, dtype):
    """3 processes: each position the sum of the three terms, added in rank order, also for
    a tensor of two and a bit slots (three pieces) and in bfloat16."""
    for equal in run_distributed(_sums, numel, dtype, world_size=3):
        assert equal == [True, True, True]


def _absent(hide_peers=False):
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    if hide_peers:  # /proc mounted with hidepid: no other process's stat
        real = shared_memory.started
        shared_memory.started = lambda pid: real(pid) if pid == os.getpid() else None
    group = SharedMemoryAllReduce.create(timeout=2)
    if dist.get_rank() == 1:
        time.sleep(4)  # running, but not in the all-reduce: hung
        return "stayed away"
    try:
        group.all_reduce_(torch.ones(10))
    except RuntimeError as error:
        return str(error)
    return "returned"


def test_a_process_that_never_comes_is_named_after_the_timeout():
    """A timeout that says so, as a collective's: under a run, the strategy's diagnosis names
    the worker (tests/distributed/test_reliability.py's hung worker)."""
    rank0, rank1 = run_distributed(_absent, world_size=2)
    assert rank1 == "stayed away"
    assert (
        rank0
        == "the shared-memory all-reduce timed out after --timeout 2 s: process 1 of this machine did not reach it"
    )


def _gone(out):
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    group = SharedMemoryAllReduce.create(timeout=60)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # The launcher stops the others 0.5 s after a process dies, then kills them 10 s later:
    # the survivor stays to say what it saw, however loaded the machine.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    began = time.monotonic()
    try:
        group.all_reduce_(torch.ones(10))
        Path(out).write_text(json.dumps(["returned", time.monotonic() - began]))
    except RuntimeError as error:
        Path(out).write_text(json.dumps([str(error), time.monotonic() - began]))
        raise


def test_a_process_killed_is_named_at_once_not_after_the_timeout(tmp_path):
    """A peer killed (SIGKILL) fails the survivor's all-reduce as a closed socket fails a
    Gloo collective, at once, not after its 60 s: the launcher that restarts the run then
    waits on no survivor (it kills one still running 10 s after asking, which leaves no
    file here)."""
    out = tmp_path / "survivor.json"
    began = time.monotonic()
    with pytest.raises(paratrain.WorkerFailed, match="SIGKILL"):
        run_distributed(_gone, str(out), world_size=2)
    assert time.monotonic() - began < 30
    message, waited = json.loads(out.read_text())
    assert message.startswith("the shared-memory all-reduce lost process 1 (pid ")
    assert message.endswith(" of this machine, gone (exited or killed)")
    assert waited < 5.0  # milliseconds on an idle machine


def test_where_proc_hides_the_peers_a_running_peer_is_not_taken_for_gone():
    """/proc mounted with hidepid shows a process no other's stat: the wait then names a
    peer after the timeout only, and never calls a running one gone."""
    rank0, rank1 = run_distributed(_absent, True, world_size=2)
    assert rank1 == "stayed away"
    assert rank0.startswith("the shared-memory all-reduce timed out after --timeout 2 s")


def _left():
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    group = SharedMemoryAllReduce.create(timeout=60)
    if dist.get_rank() == 1:
        group.leave()  # gone on to another group (a fault-tolerant run's next quorum)
        return "left"
    began = time.monotonic()
    try:
        group.all_reduce_(torch.ones(10))
        return ["returned", time.monotonic() - began]
    except RuntimeError as error:
        first = [str(error), time.monotonic() - began]
    try:  # a process whose sum failed has left the buffer too: no later sum of it
        group.all_reduce_(torch.ones(10))
    except RuntimeError as error:
        return [*first, str(error)]
    return [*first, "returned"]


def test_a_process_that_left_fails_its_peer_s_sum_at_once_and_the_failure_stays():
    """A process that ``leave``s fails the sum a peer waits in within milliseconds, not the
    60-s timeout, as a peer's aborted Gloo group fails a collective; the failed process has
    left the buffer too."""
    rank0, rank1 = run_distributed(_left, world_size=2)
    assert rank1 == "left"
    message, waited, then = rank0
    assert message == "process 1 left the shared-memory all-reduce before this sum (gone on to another group)"
    assert waited < 5.0
    assert then == "this process left the shared-memory all-reduce (an earlier sum of it failed)"


def _elsewhere():
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    real = shared_memory.host_identity
    shared_memory.host_identity = lambda: (*real()[:2], f"namespace {dist.get_rank()}")  # as on emulated hosts
    return SharedMemoryAllReduce.create() is None


def test_processes_in_other_network_namespaces_keep_gloo():
    assert run_distributed(_elsewhere, world_size=2) == [True, True]


def _other_file(folder):
    import torch.distributed as dist

    paratrain.AllReduceStrategy(device="cpu").setup()
    if dist.get_rank() == 1:  # its /dev/shm is another (a container of its own): the name maps another file
        real = shared_memory._map
        shared_memory._map = lambda path, nbytes, create: real(Path(folder) / "other", nbytes, True)
    return SharedMemoryAllReduce.create() is None


def test_a_process_that_maps_another_file_under_the_name_keeps_gloo_for_all(tmp_path):
    assert run_distributed(_other_file, str(tmp_path), world_size=2) == [True, True]


def _run(cli, tmp_path, workers, *flags):
    out = tmp_path / f"m-{workers}-{'-'.join(flags) or 'single'}.json"
    strategy = ["--strategy", "allreduce", "--workers", str(workers)] if workers > 1 else []
    result = cli(
        "train",
        *strategy,
        "--batch-size",
        str(48 // workers),
        "--epochs",
        "2",
        "--no-progress",
        "--log-every",
        "0",
        "--device",
        "cpu",
        "--seed",
        "4",
        *flags,
        "--metrics-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_fault_tolerant_run_sums_through_shared_memory_as_over_gloo(cli, tmp_path):
    """allreduce-ft's quorum groups on one machine: each sums through shared memory (one
    group, no loss), 2 replicas' sums Gloo's to the bit; --no-shared-memory keeps Gloo."""
    flags = ("--fault-tolerant",)
    shared, gloo = _run(cli, tmp_path, 2, *flags), _run(cli, tmp_path, 2, *flags, "--no-shared-memory")
    # groups formed: one without a loss, more where a loaded machine delays a heartbeat past the
    # deadline and the quorum forms again; every one of them sums the same way
    assert shared["quorum_sums_via"]["shared memory"] >= 1 and shared["quorum_sums_via"]["gloo"] == 0
    assert gloo["quorum_sums_via"]["shared memory"] == 0 and gloo["quorum_sums_via"]["gloo"] >= 1
    assert shared["test_loss"] == gloo["test_loss"]


def test_a_run_through_shared_memory_is_gloo_s_on_two_processes_and_single_s_on_three(cli, tmp_path):
    """Two terms have one sum: 2 processes equal Gloo's run to the bit; on 3, the run of one
    process with the global batch (48) to float32 rounding."""
    shared, gloo = _run(cli, tmp_path, 2), _run(cli, tmp_path, 2, "--no-shared-memory")
    assert shared["allreduce_via"] == "shared memory" and gloo["allreduce_via"] == "gloo"
    assert shared["test_loss"] == gloo["test_loss"]
    three, single = _run(cli, tmp_path, 3), _run(cli, tmp_path, 1)
    assert three["allreduce_via"] == "shared memory"
    assert three["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
