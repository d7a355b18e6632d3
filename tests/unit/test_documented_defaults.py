"""The waits' production defaults are what the docs say: tests run with short ones
(--timeout, --heartbeat-timeout, --replica-heartbeat-timeout as flags), so nothing else
would notice a default that drifted from its documentation."""

from pathlib import Path

from paratrain.config import DEFAULT_TIMEOUT_S, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_timeouts_the_docs_name_are_the_defaults():
    config = TrainConfig()
    assert config.timeout == DEFAULT_TIMEOUT_S == 60.0
    readme = (ROOT / "README.md").read_text()
    failures = (ROOT / "docs" / "failures.md").read_text()
    fault_tolerance = (ROOT / "docs" / "fault_tolerance.md").read_text()
    ps = (ROOT / "docs" / "parameter_server.md").read_text()
    assert f"`--timeout` (default {config.timeout:g} s)" in readme
    assert f"`--timeout` seconds (default {config.timeout:g})" in failures
    assert f"`--replica-heartbeat-timeout` seconds ({config.ft.replica_heartbeat_timeout:g} s)" in fault_tolerance
    assert f"`--heartbeat-timeout` seconds, default {config.heartbeat_timeout:g})" in ps
