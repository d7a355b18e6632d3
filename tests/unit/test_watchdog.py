"""The replica's watchdog: a phase that outlives its bound ends the process with one line
naming the phase, the step and the worker; a phase that ends in time, or no phase at all,
ends nothing."""

import pickle
import subprocess
import sys
import textwrap
import time

from paratrain.session.watchdog import POLL_S, Watchdog

STUCK = textwrap.dedent(
    """
    import time
    from paratrain.session.watchdog import Watchdog

    watchdog = Watchdog(0.5, "a test's bound", worker=2)
    with watchdog.phase("all-reduce", 41):
        pass  # in time
    time.sleep(1.0)  # between phases: nothing to watch
    with watchdog.phase("all-reduce", 42):
        time.sleep(60)  # stuck (as in a native wait)
    """
)


def test_a_phase_stuck_past_its_bound_ends_the_process_with_one_line_naming_it():
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "paratrain: worker 2: the all-reduce of step 42 did not end within 0.5 s (a test's bound); the replica exits"
    ]
    assert took < 1.0 + 0.5 + 4 * POLL_S + 5  # the sleep between, the bound, the polls, an interpreter's start


def test_phases_that_end_in_time_and_a_stopped_watchdog_end_nothing():
    exits = []
    watchdog = Watchdog(0.3, "bound", exit=exits.append)
    for step in range(5):
        with watchdog.phase("quorum", step):
            time.sleep(0.1)
    time.sleep(0.6)  # no phase: nothing is stuck
    watchdog.stop()
    with watchdog.phase("commit", 6):
        time.sleep(0.6)  # past the bound, but the watchdog was stopped (the run's teardown)
    assert exits == []


def test_a_watchdog_sent_to_another_process_is_a_new_one_there():
    watchdog = Watchdog(0.3, "bound", worker=4)
    with watchdog.phase("quorum", 1):
        copy = pickle.loads(pickle.dumps(watchdog))
    assert (copy.bound, copy.why, copy.worker) == (0.3, "bound", 4)
    assert copy._phase is None and copy._thread is None
