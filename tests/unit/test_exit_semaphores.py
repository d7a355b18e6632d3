"""A process that ends with ``exit_now`` (os._exit, no interpreter finalization) releases the
named semaphores it made: tqdm's lock, which ``datasets`` makes in every process that formats
a batch as tensors, was reported at the end of every GPT-2 run as "leaked semaphore objects"."""

import subprocess
import sys

import pytest

SCRIPT = """
import multiprocessing, os, sys
multiprocessing.set_start_method("forkserver")  # a run's processes': their semaphores are named
from tqdm import tqdm
from paratrain.launch.process import exit_now
for _ in tqdm(range(3), disable=True):  # a disabled bar makes the lock too
    pass
from tqdm.std import TqdmDefaultWriteLock
assert TqdmDefaultWriteLock.mp_lock is not None  # a named semaphore, known to the resource tracker
exit_now(0) if sys.argv[1] == "exit_now" else os._exit(0)
"""


@pytest.mark.parametrize("ending", ["exit_now", "os._exit"])
def test_a_process_ended_at_once_leaves_no_semaphore_behind(ending):
    result = subprocess.run([sys.executable, "-c", SCRIPT, ending], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    leaked = "leaked semaphore" in result.stderr
    assert leaked == (ending == "os._exit"), result.stderr  # the tracker tells a leak (and so the test can fail)
