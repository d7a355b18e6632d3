"""``paratrain bench --quick`` end to end: one small suite, its JSON and Markdown."""

import json

import pytest

pytestmark = pytest.mark.distributed


def test_quick_allreduce_suite_writes_json_and_markdown(cli, tmp_path):
    result = cli("bench", "--quick", "--suites", "allreduce", "--out", str(tmp_path / "bench"))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert document["quick"] is True and list(document["suites"]) == ["allreduce"]
    mlp = document["suites"]["allreduce"]["results"]["models"]["mlp"]
    assert mlp["steps_per_round"] == 1433 // 64 and mlp["rounds"] == 3
    assert mlp["paratrain_ms_per_step"] > 0 and mlp["raw_ddp_ms_per_step"] > 0
    # Both sides took the same steps on the same batches from the same weights.
    assert mlp["max_weight_difference_at_end"] < 1e-5
    markdown = (tmp_path / "bench" / "bench.md").read_text()
    assert "## allreduce" in markdown and "| mlp | 22 |" in markdown
    assert markdown.strip() in result.stdout


@pytest.mark.parametrize("mode", ["local-sgd", "fsdp"])
def test_overhead_rounds_take_the_same_steps_as_pytorchs_own_loop(mode):
    """The overhead suite's pairs: paratrain's local-sgd against PyTorch's
    PeriodicModelAverager, fsdp against a plain fully_shard loop, alternating in the same
    processes, end with the same weights (so they timed the same work)."""
    from paratrain.bench.overhead import pair_worker
    from paratrain.launch.local import launch

    result = launch(pair_worker, mode, ["mlp"], 32, 2, num_processes=2)[0]["mlp"]
    assert result["steps_per_round"] == 1433 // 64
    assert result["max_weight_difference_at_end"] < 1e-5
    assert result["mode_ms_per_step"] > 0 and result["reference_ms_per_step"] > 0
