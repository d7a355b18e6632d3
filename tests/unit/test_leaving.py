"""Leaving on SIGTERM (session/leaving.py): the first SIGTERM asks, the second ends the
process, and the run's end puts back the handler that was there before."""

import signal
import subprocess
import sys
import textwrap

from paratrain.session.leaving import LeaveOnSigterm


def test_the_handler_before_the_run_is_back_after_it():
    before = signal.getsignal(signal.SIGTERM)
    leaving = LeaveOnSigterm()
    leaving.install()
    leaving.install()  # a second fit in the same run: still one handler to put back
    assert signal.getsignal(signal.SIGTERM) == leaving._handle
    leaving.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    leaving.uninstall()  # nothing left to put back
    assert signal.getsignal(signal.SIGTERM) is before


SIGNALLED = textwrap.dedent(
    """
    import os, signal, time
    from paratrain.session.leaving import LeaveOnSigterm

    leaving = LeaveOnSigterm()
    leaving.install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("asked", leaving.asked, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("still here", flush=True)
    """
)


def test_the_first_sigterm_asks_and_the_second_ends_the_process():
    result = subprocess.run([sys.executable, "-c", SIGNALLED], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout.split() == ["asked", "True"]
