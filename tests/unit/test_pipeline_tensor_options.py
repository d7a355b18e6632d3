"""``--tensor-parallel`` and ``--tp-plan`` under ``pipeline`` (3-D: data x pipeline x tensor):
the layout from the options alone, the defaults of each strategy, and what is refused in
one line (exit 2) before any process starts."""

import pytest

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.strategies.pipeline.strategy import PipelineStrategy
from paratrain.strategies.pipeline.topology import PipelineTopology


def test_the_mesh_lays_a_stage_s_shards_on_neighbouring_ranks():
    """rank = (replica x S + stage) x T + shard; the chief is shard 0 of the last stage of
    replica 0; the groups of each dimension of the mesh."""
    topology = TrainConfig(strategy="pipeline", workers=8, tensor_parallel=2).topology
    assert topology == PipelineTopology(num_replicas=2, num_stages=2, tensor=2)
    assert topology.num_processes == 8 and topology.chief_rank == 2
    assert [(topology.replica(r), topology.stage(r), topology.shard(r)) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]
    assert topology.rank_name(5) == "tensor shard 1 of stage 0 of replica 1"
    assert topology.groups() == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }


def test_each_strategy_keeps_its_own_default():
    """Not given, --tensor-parallel is 2 for tensor (as it always was) and 1 for pipeline (no
    split: the pipeline of before, W/S replicas)."""
    assert TrainConfig(strategy="tensor").topology.num_processes == 2
    plain = TrainConfig(strategy="pipeline", workers=4).topology
    assert (plain.num_replicas, plain.tensor, plain.rank_name(3)) == (2, 1, "stage 1 of replica 1")
    assert TrainConfig(strategy="pipeline", tensor_parallel=2, tp_plan='{"*.fc": "colwise"}').topology.tensor == 2
    assert TrainConfig(strategy="pipeline", workers=4, tensor_parallel=1).topology.num_replicas == 2


def test_the_python_api_refuses_what_3d_does_not_run():
    with pytest.raises(
        ConfigError, match="--schedule wavefront is not available with --strategy pipeline --tensor-parallel"
    ):
        PipelineStrategy(2, 4, "wavefront", tensor_parallel=2)
    with pytest.raises(ConfigError, match="--balance time is not available"):
        PipelineStrategy(2, 4, balance="time", tensor_parallel=2)
    with pytest.raises(ConfigError, match="tensor_parallel must be a whole number >= 1"):
        PipelineStrategy(2, 4, tensor_parallel=0)
    with pytest.raises(ConfigError, match="--tp-plan splits a pipeline's stages"):
        PipelineStrategy(2, 4, tp_plan={"*.fc": "colwise"})
    assert PipelineStrategy(2, 4, tensor_parallel=2, workers=8).planned_topology().num_replicas == 2


GPT = [
    "--model",
    "gpt",
    "--dataset",
    "text-lm",
    "--seq-len",
    "16",
    "--gpt-layers",
    "2",
    "--gpt-width",
    "32",
    "--gpt-heads",
    "4",
    "--epochs",
    "1",
]
PIPELINE = ["--strategy", "pipeline", "--stages", "2", "--tensor-parallel", "2"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([*PIPELINE, "--workers", "6"], "--workers 6 is not a multiple of --stages 2 x --tensor-parallel 2"),
        ([*PIPELINE, "--shard-replicas"], "--shard-replicas applies to --strategy tensor, not to --strategy pipeline"),
        (
            [*PIPELINE, "--no-loss-parallel"],
            "--no-loss-parallel applies to --strategy tensor, not to --strategy pipeline",
        ),
        (
            ["--strategy", "allreduce", "--tensor-parallel", "2"],
            "--tensor-parallel applies to --strategy tensor and pipeline, not to --strategy allreduce",
        ),
        (
            ["--strategy", "pipeline", "--fault-tolerant", "--tensor-parallel", "2"],
            "--tensor-parallel applies to --strategy tensor and pipeline, not to --strategy pipeline-ft",
        ),
        (["--strategy", "single", "--tp-plan", "{}"], "--tp-plan applies to --strategy tensor and pipeline"),
        (
            [*PIPELINE, "--precision", "bf16"],
            "--precision bf16 is not available with --strategy pipeline --tensor-parallel",
        ),
        ([*PIPELINE, "--precision", "fp16"], "--precision fp16 needs a gradient scaler"),
        ([*PIPELINE, "--channels-last"], "--channels-last is not available with --strategy pipeline --tensor-parallel"),
        ([*PIPELINE, "--activation-checkpointing", "blocks"], "--activation-checkpointing blocks is not available"),
        ([*PIPELINE, "--compression", "fp16"], "--compression fp16: --strategy pipeline sends no gradients"),
        ([*PIPELINE, "--compile"], "--compile is not available with --strategy pipeline"),
        (
            [*PIPELINE, "--balance", "time"],
            "--balance time is not available with --strategy pipeline --tensor-parallel",
        ),
        ([*PIPELINE, "--schedule", "wavefront", "--microbatches", "2"], "--schedule wavefront is not available"),
        ([*PIPELINE, "--tp-plan", '{"*.mlp.9": "colwise"}'], "'*.mlp.9' names no module of GPT"),
        ([*PIPELINE, "--tensor-parallel", "3"], "not a multiple of 3"),
        (["--strategy", "pipeline", "--tp-plan", "{}"], "--tp-plan splits a pipeline's stages over --tensor-parallel"),
    ],
)
def test_refused_in_one_line_with_exit_2_before_any_process_starts(cli, flags, says):
    result = cli("train", *GPT, *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
