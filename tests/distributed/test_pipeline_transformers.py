"""A Hugging Face GPT-2 (built from a config), its ``datasets.Dataset`` of dict examples and
its own loss through ``pipeline``: the model is traced and cut between its blocks, the tied
embedding and output layer land on the first and the last stage, and the run equals one
process with the global batch."""

import json
import re

import pytest
import torch

import paratrain
from paratrain.strategies.base import current_strategy
from paratrain.testing import relative_difference, run_distributed
from tests.conftest import TRACED_PIPELINE
from tests.distributed.test_transformers import PROJECT, SEQ, STEPS, B, gpt2, optimizer_for, tokens

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")


def _train(strategy, replicas, optimizer):
    """One epoch of STEPS global batches of 2B examples; the parameters this process holds
    by the model's names (a stage's copy of the tied weight under its own name), the
    history."""
    model = gpt2()
    trainer = paratrain.Trainer(model, optimizer=optimizer_for(model, optimizer), strategy=strategy, metrics=())
    data, test = tokens(STEPS * 2 * B), tokens(10)  # 10: the test batch is not a whole micro-batch
    history = trainer.fit(data, epochs=1, batch_size=2 * B // replicas, seed=0, verbose=0, validation_data=test)
    params = {
        n.removeprefix("model."): p.detach().clone() for n, p in trainer.module.named_parameters(remove_duplicate=False)
    }
    strategy.teardown()
    return params, history.history


def _pipelined(schedule, replicas, optimizer):
    strategy = paratrain.PipelineStrategy(num_stages=2, num_microbatches=2, schedule=schedule, device="cpu")
    return _train(strategy, replicas, optimizer)


@TRACED_PIPELINE
@pytest.mark.parametrize(("schedule", "replicas"), [("1f1b", 2), ("gpipe", 1)])
def test_a_gpt2_pipelined_in_two_stages_equals_one_process(schedule, replicas):
    """Stage 0 holds the embeddings and block 0, stage 1 block 1, the last norm and the
    output layer: each stage's parameters, the training loss and the test loss are the
    single process's up to float rounding (the gradients are sums in another order)."""
    reference, single = _train(paratrain.SingleDeviceStrategy(device="cpu"), 1, "sgd")
    stages = run_distributed(_pipelined, schedule, replicas, "sgd", world_size=2 * replicas)
    held = [set(params) for params, _ in stages[:2]]
    assert "transformer.wte.weight" in held[0] and "transformer.h.0.attn.c_attn.weight" in held[0]
    assert "lm_head.weight" in held[1] and "transformer.h.1.attn.c_attn.weight" in held[1]
    for params, history in stages:
        for name, value in params.items():
            assert relative_difference(value.reshape(-1), reference[name].reshape(-1)) < 1e-5, name
        assert history["train_loss"][0] == pytest.approx(single["train_loss"][0], rel=1e-5)
        assert history["test_loss"][0] == pytest.approx(single["test_loss"][0], rel=1e-5)
    # The output layer trained as the embedding it is tied to (stage 1's copy, stage 0's).
    assert relative_difference(stages[1][0]["lm_head.weight"], stages[0][0]["transformer.wte.weight"]) < 1e-5
    assert relative_difference(reference["transformer.wte.weight"], gpt2().transformer.wte.weight.detach()) > 1e-3


@TRACED_PIPELINE
def test_a_gpt2_pipelined_with_adamw_trains_as_one_process():
    """AdamW divides by the root of each gradient's square: where a gradient is rounding noise
    (a key's bias, which softmax ignores) the noise takes whole steps, so the parameters are
    compared where it matters, the loss, to 1e-4."""
    _, single = _train(paratrain.SingleDeviceStrategy(device="cpu"), 1, "adamw")
    for _, history in run_distributed(_pipelined, "1f1b", 1, "adamw", world_size=2):
        assert history["train_loss"][0] == pytest.approx(single["train_loss"][0], rel=1e-4)
        assert history["test_loss"][0] == pytest.approx(single["test_loss"][0], rel=1e-4)


@TRACED_PIPELINE
def test_a_gpt2_trains_pipelined_from_the_command_line(cli, tmp_path):
    """--split-points names the block where stage 1 starts; the model's own loss learns to
    count on (from ln 64 = 4.16), the test loss over both stages."""
    (tmp_path / "hfgpt.py").write_text(PROJECT)
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "hfgpt:model",
        "--dataset",
        "hfgpt:data",
        "--loss",
        "model",
        "--metrics",
        "",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--epochs",
        "4",
        "--batch-size",
        "8",
        "--no-progress",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--split-points",
        "transformer.h.1",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["global_steps"] == 4 * 64 // 8 and metrics["test_loss"] < 2.5
    assert metrics["split"] == ["transformer.h.1"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--split-points", "transformer.h.9"], "GPT2LMHeadModel has no module 'transformer.h.9'"),
        (["--split-points", "1,transformer.h.1"], "all layer indices (3,7) or all module names"),
        (
            ["--stages", "3", "--microbatches", "4"],
            "--stages 3 is more than the 2 blocks of GPT2LMHeadModel (transformer.h)",
        ),
        (["--balance", "time"], "--balance time times the layers of an nn.Sequential"),
    ],
)
def test_a_bad_split_of_a_gpt2_exits_2_with_one_line(cli, tmp_path, flags, words):
    (tmp_path / "hfgpt.py").write_text(PROJECT)
    result = cli(
        "train",
        "--model",
        "hfgpt:model",
        "--dataset",
        "hfgpt:data",
        "--loss",
        "model",
        "--metrics",
        "",
        "--strategy",
        "pipeline",
        "--epochs",
        "1",
        *flags,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def _in_scope(replicas, optimizer):
    """In each process of ``paratrain.launch(..., strategy=s)``: train under ``s``."""
    return _train(current_strategy(), replicas, optimizer)


@TRACED_PIPELINE
def test_a_gpt2_under_pipeline_ft_equals_one_process():
    """Two fault-tolerant pipeline replicas of two stages (torchft's Manager, a Lighthouse),
    each tracing the GPT-2 at its first batch before the first quorum and running half of
    every global batch's micro-batches: one process's parameters, stage by stage."""
    pytest.importorskip("torchft")
    reference, single = _train(paratrain.SingleDeviceStrategy(device="cpu"), 1, "sgd")
    strategy = paratrain.FaultTolerantPipelineStrategy(num_stages=2, num_microbatches=2, workers=4, device="cpu")
    stages = paratrain.launch(_in_scope, 2, "sgd", strategy=strategy)
    assert len(stages) == 4
    for params, history in stages:
        assert "lm_head.weight" in params or "transformer.wte.weight" in params
        for name, value in params.items():
            assert relative_difference(value.reshape(-1), reference[name].reshape(-1)) < 1e-5, name
        assert history["test_loss"][0] == pytest.approx(single["test_loss"][0], rel=1e-5)


@TRACED_PIPELINE
@pytest.mark.matrix  # a pipeline replica replaced: test_fault_tolerant_pipeline.py; a GPT-2 under pipeline-ft: above
def test_a_gpt2_pipeline_replica_lost_mid_run_is_replaced_and_the_run_learns(cli, tmp_path):
    """Replica 1's stages are killed after step 4 of 96: the survivor goes on, a replacement
    pair of stages traces the model at its first batch, takes each stage's state from the
    survivor's and joins (measured: about 50 steps later, at step 59 of a run killed at 10);
    the run ends with every step, both replicas again, and the model's loss learned."""
    pytest.importorskip("torchft")
    (tmp_path / "hfgpt.py").write_text(PROJECT)
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "hfgpt:model",
        "--dataset",
        "hfgpt:data",
        "--loss",
        "model",
        "--metrics",
        "",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--epochs",
        "24",
        "--batch-size",
        "8",
        "--no-progress",
        "--strategy",
        "pipeline-ft",
        "--stages",
        "2",
        "--workers",
        "4",
        "--microbatches",
        "2",
        "--fail",
        "1@4",
        "--max-restarts",
        "1",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replica 1 was lost (killed by SIGKILL) after step 4" in result.stderr
    assert re.search(r"worker [23] joined the run at step \d+ with a live peer's state", result.stderr)
    metrics = json.loads(out.read_text())
    spans = metrics["participants"]["per_step"]
    assert spans[0] == [1, 4, 2] and spans[-1][1:] == [24 * 64 // 16, 2], spans
    assert metrics["test_loss"] < 1.0  # from ln 64 = 4.16; 0.03 measured


def test_a_batch_with_padding_or_another_loss_is_refused():
    """The traced graph has no attention mask, and a dict batch is scored by the model's own loss."""
    from paratrain.errors import ConfigError
    from paratrain.strategies.pipeline.stages import feed, stage_loss

    batch = tokens(4)[:]
    batch = {k: torch.tensor(v) for k, v in batch.items()}
    assert [k for k in feed(batch)[1]] == ["input_ids"]
    batch["attention_mask"][0, -2:] = 0
    with pytest.raises(ConfigError, match="attention_mask masks positions"):
        feed(batch)
    with pytest.raises(ConfigError, match="leave the loss out"):
        stage_loss(gpt2(), torch.nn.functional.cross_entropy, batch)


@TRACED_PIPELINE
def test_tracing_twice_leaves_the_model_as_it_was():
    """The tracer wraps the split modules' forward in place: a second trace (the evaluation
    graph) works, and the model runs its own forward again after."""
    from paratrain.parallel.traced import trace

    model, x = gpt2(), torch.randint(0, 64, (2, SEQ))
    model.eval()
    before = model(input_ids=x).logits
    for train in (True, False):
        assert trace(model, ("input_ids",), (x,), ["transformer.h.1"], train=train).num_stages == 2
    block = model.transformer.h[1]
    assert "forward" not in vars(block) and "_orig_forward" not in vars(block) and not model.training
    torch.testing.assert_close(model(input_ids=x).logits, before, rtol=0, atol=0)
