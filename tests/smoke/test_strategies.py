"""One short run of each strategy from the command line, for ``scripts/test.sh --quick``:
it trains, learns (10 classes: chance is 0.1) and every process exits 0. The full suite
checks each strategy against the single-process reference; this catches a broken one in
seconds."""

import json

import pytest

pytestmark = pytest.mark.distributed

STRATEGIES = {
    "single": [],
    "allreduce": ["--workers", "2"],
    "allreduce-ft": ["--workers", "2"],
    "ps-sync": ["--workers", "2"],
    "ps-backup": ["--workers", "2", "--backup-workers", "1"],
    "ps-async": ["--workers", "2"],
    "pipeline": ["--stages", "2"],
    "pipeline-ft": ["--stages", "2", "--workers", "4"],
    "local-sgd": ["--workers", "2", "--sync-every", "4"],
    "diloco": ["--workers", "2", "--sync-every", "4"],
    "fsdp": ["--workers", "2"],
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_strategy_trains_and_exits(cli, tmp_path, name):
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--strategy",
        name,
        *STRATEGIES[name],
        "--epochs",
        "1",
        "--no-progress",
        "--metrics-out",
        str(out),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["strategy"] == name and metrics["global_steps"] > 0
    assert metrics["test_accuracy"] > 0.5
