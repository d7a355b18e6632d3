"""What users already have keeps working: checkpoints written by paratrain 0.1.0 (before the
strategy seams were redesigned) resume, and every flag spelling of 0.1.0 is still taken.

The fixtures in tests/fixtures/checkpoints-0.1.0 were written by

    paratrain train --strategy single --epochs 1 --momentum 0 --seed 3 \
        --checkpoint-dir single --checkpoint-every 20 --keep 1
    paratrain train --strategy ps-sync --workers 2 --epochs 1 --momentum 0 --seed 3 \
        --checkpoint-dir ps-sync --checkpoint-every 20 --keep 1

Resuming them for a second epoch must give exactly what an uninterrupted two-epoch run
gives (resume is bit-for-bit on the CPU for single and ps-sync).
"""

import json
import shutil

import pytest

from tests.conftest import REPO, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "checkpoints-0.1.0"
COMMON = ["--epochs", "2", "--momentum", "0", "--seed", "3", "--checkpoint-every", "20", "--keep", "1"]


@pytest.mark.parametrize("strategy", [["single"], ["ps-sync", "--workers", "2"]], ids=["single", "ps-sync"])
def test_a_checkpoint_of_0_1_0_resumes_to_the_uninterrupted_run(tmp_path, strategy):
    folder = tmp_path / "ck"
    shutil.copytree(FIXTURES / strategy[0], folder)
    step = int(next(folder.glob("ckpt-*")).name.removeprefix("ckpt-"))
    resumed_out, fresh_out = tmp_path / "resumed.json", tmp_path / "fresh.json"
    resumed = run_cli(
        "train",
        "--strategy",
        *strategy,
        *COMMON,
        "--checkpoint-dir",
        str(folder),
        "--resume",
        "--metrics-out",
        str(resumed_out),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    fresh = run_cli(
        "train",
        "--strategy",
        *strategy,
        *COMMON,
        "--checkpoint-dir",
        str(tmp_path / "fresh-ck"),
        "--metrics-out",
        str(fresh_out),
    )
    assert fresh.returncode == 0, fresh.stderr
    got, want = json.loads(resumed_out.read_text()), json.loads(fresh_out.read_text())
    assert got["resumed_from_step"] == step
    assert got["global_steps"] == want["global_steps"]
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-6)
    assert got["test_accuracy"] == want["test_accuracy"]
