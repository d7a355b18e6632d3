"""The host allocator's setting (launch/allocator.py): freed CPU tensors stay in the process."""

import platform
import subprocess
import sys

import pytest

# Three tensors (20 MiB; 48 MiB) made, touched and freed together, as a step's activations are: the
# minor page faults of 10 such steps after a first, per page the step touches. The process
# first imports what a run's processes import (the heap's layout, and so the share faulted
# in, depends on it: 3% after those imports, 23-40% after torch's alone).
STEPS = """
import resource, sys, torch
import paratrain.train.job  # what a run's process has imported before its first step
from paratrain.launch.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
floats = int(sys.argv[2])
def step():
    tensors = [torch.ones(floats) for _ in range(3)]
    del tensors
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10 / (3 * floats * 4 / 4096))
"""


def faulted_share(mode: str, mib: int = 20) -> float:
    floats = str(mib << 18)
    out = subprocess.run([sys.executable, "-c", STEPS, mode, floats], capture_output=True, text=True, check=True)
    return float(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc malloc's")
def test_kept_memory_is_not_faulted_in_again_every_step():
    # glibc by default gives the freed heap top back and maps it in again, zero-filled, the
    # next step (here 13% or 70% of the pages, as the heap happens to lie); kept, a page is
    # faulted in once (the 3% left: other allocations of the step).
    kept = faulted_share("keep")
    assert kept < 0.06
    assert faulted_share("system") > 2 * kept


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc malloc's")
def test_blocks_above_the_highest_mmap_threshold_are_kept_too():
    # 48 MiB blocks (an LSTM's workspace, a large batch's activations): above the 32 MiB
    # that glibc's mmap threshold cannot be raised past, so with the thresholds alone each
    # is mapped and every page of it faulted in again each step (a share of about 1).
    assert faulted_share("keep", mib=48) < 0.06
    assert faulted_share("system", mib=48) > 0.5


def test_the_trainer_keeps_host_memory_unless_told_not_to(monkeypatch):
    import torch

    import paratrain
    from paratrain.train import cpu_tuning

    calls = []
    monkeypatch.setattr(cpu_tuning, "keep_freed_memory", lambda: calls.append(1))
    model = torch.nn.Linear(4, 2)
    paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
    assert calls == [1]
    paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.1),
        cpu=paratrain.CpuTuning(keep_host_memory=False),
    )
    assert calls == [1]
