"""``paratrain cluster run --fail/--cut``: faults placed by the clock or by the run's step."""

import pytest

from paratrain.cluster.watch import Fault, faults
from paratrain.errors import ConfigError


def test_a_fault_is_placed_by_seconds_or_by_step():
    by_clock, by_step = faults(["host1@2.5s", "host3@step40"], "fail", hosts=4)
    assert by_clock == Fault("fail", 1, seconds=2.5)
    assert by_step == Fault("fail", 3, step=40)
    assert not by_clock.due(now=2.4, step=10_000) and by_clock.due(now=2.5, step=0)
    assert not by_step.due(now=1e9, step=39) and by_step.due(now=0.0, step=40)


@pytest.mark.parametrize("text", ["host4@1s", "host1@step0", "host1@40", "host1@-1s", "h1@2s", "host1@steps4"])
def test_a_malformed_fault_is_one_line_naming_the_forms(text):
    with pytest.raises(ConfigError) as error:
        faults([text], "cut", hosts=4)
    assert str(error.value).startswith(f"--cut {text}: expected hostI@Ts or hostI@stepN") or "must be >= 1" in str(
        error.value
    )
