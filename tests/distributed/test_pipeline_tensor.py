"""3-D parallelism: ``pipeline --tensor-parallel T``, each stage split over T processes by the
plan of ``--strategy tensor``, against one process of the same global batch: the built-in gpt
(an nn.Sequential cut into layers) and a transformers GPT-2 (traced into stages), both with
the output layer tied to the token embedding on the other stage; from Python and from the
command line, on 4 processes (2 stages x 2 shards) and 8 (2 replicas of them)."""

import json
import re

import pytest
import torch

import paratrain
from paratrain.testing import relative_difference, run_distributed
from tests.conftest import PACKED_TP, TRACED_PIPELINE
from tests.distributed.test_tensor_loss import STEPS, B, gpt, sequences

pytestmark = pytest.mark.distributed


def _train(strategy, build, data, loss, clip=None, accumulate=1):
    """One epoch of SGD; each step's loss here, the test loss, and this process's parameters by
    the model's names: each whole (gathered over the stage's shards) and what this process
    holds of it against its whole size."""
    model = build()
    trainer = paratrain.Trainer(
        model,
        loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        metrics=(),
        strategy=strategy,
        clip_grad_norm=clip,
        accumulate=accumulate,
    )
    losses = []
    record = paratrain.Callback()
    record.on_batch_end = lambda step, logs: losses.append(float(logs["local_loss"]))
    train, test = data
    history = trainer.fit(
        train, epochs=1, batch_size=B // accumulate, seed=0, verbose=0, validation_data=test, callbacks=[record]
    )
    whole, held = {}, {}
    for name, param in trainer.module.named_parameters(remove_duplicate=False):
        name = name.removeprefix("model.")
        local = param.to_local() if hasattr(param, "to_local") else param
        whole[name] = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        held[name] = (local.numel(), param.numel())
    last = getattr(strategy, "is_last_stage", True)
    strategy.teardown()
    return {"losses": losses, "test": history.history["test_loss"][0], "whole": whole, "held": held, "last": last}


def _pipelined(build, data, loss, clip=None, accumulate=1):
    strategy = paratrain.PipelineStrategy(num_stages=2, num_microbatches=2, tensor_parallel=2, device="cpu")
    return _train(strategy, build, data, loss, clip, accumulate)


def _split(held):
    """The parameters this process holds half of."""
    return {name for name, (here, whole) in held.items() if 2 * here == whole}


@PACKED_TP
def test_the_builtin_gpt_in_2_stages_of_2_shards_equals_one_process_step_by_step():
    """Stage 0 holds the embeddings and block 0, stage 1 block 1 and the head, whose output
    layer is the token embedding's weight: each step's loss (on the last stage), the test loss
    and every parameter equal one process's (1e-5); each process holds half of each split
    weight of its stage (the vocabulary's rows of the tied embedding on both stages) and the
    whole of the rest."""
    data = (sequences(STEPS * B, 1), sequences(2 * B, 2))
    single = _train(paratrain.SingleDeviceStrategy(device="cpu"), gpt, data, "cross_entropy")
    runs = run_distributed(_pipelined, gpt, data, "cross_entropy", world_size=4)
    block = {
        "attention.qkv.weight",
        "attention.qkv.bias",
        "attention.out.weight",
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
    }
    expected = [{"0.token.weight", *(f"1.{n}" for n in block)}, {*(f"0.{n}" for n in block), "1.output.weight"}]
    for rank, run in enumerate(runs):
        stage = rank // 2
        assert run["last"] == (stage == 1)
        if stage == 1:
            assert run["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert run["test"] == pytest.approx(single["test"], rel=1e-5)
        assert _split(run["held"]) == expected[stage]
        assert all(here == whole for name, (here, whole) in run["held"].items() if name not in expected[stage])
        for name, value in run["whole"].items():
            index, _, rest = name.partition(".")
            model_name = f"{int(index) + 2 * stage}.{rest}"  # a stage counts its layers from 0 again
            assert relative_difference(value.reshape(-1), single["whole"][model_name].reshape(-1)) < 1e-5, name
    assert relative_difference(single["whole"]["0.token.weight"], gpt()[0].token.weight.detach()) > 1e-3


@PACKED_TP
def test_clipping_takes_the_norm_over_every_stage_and_split_and_accumulation_the_whole_batch():
    """A clip norm below the gradient's (0.5: the clipped run ends elsewhere than the unclipped)
    scales every step: the norm must be the whole model's, each split part counted once, a
    whole (replicated) gradient once per stage, the tied weight once; --accumulate 2 of half
    batches makes the step of the whole batch. Each step's loss and the test loss equal one
    process's (1e-5)."""
    data = (sequences(STEPS * B, 1), sequences(2 * B, 2))
    single = _train(paratrain.SingleDeviceStrategy(device="cpu"), gpt, data, "cross_entropy", clip=0.5)
    unclipped = _train(paratrain.SingleDeviceStrategy(device="cpu"), gpt, data, "cross_entropy")
    assert unclipped["test"] != pytest.approx(single["test"], rel=1e-3)
    for rank, run in enumerate(run_distributed(_pipelined, gpt, data, "cross_entropy", 0.5, 2, world_size=4)):
        if rank >= 2:
            assert run["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert run["test"] == pytest.approx(single["test"], rel=1e-5)


@TRACED_PIPELINE
def test_a_gpt2_traced_into_2_stages_of_2_shards_equals_one_process():
    """transformers' GPT-2 (fused query-key-value, head counts in attributes, its own loss on
    dict batches, lm_head tied to wte) traced into stages with its split shapes: each step's
    loss, the test loss and every parameter equal one process's (1e-5); each process holds
    half of each split weight of its stage."""
    pytest.importorskip("transformers")
    from tests.distributed.test_transformers import gpt2, tokens

    data = (tokens(STEPS * B), tokens(10))  # 10: the test batch is not a whole micro-batch
    single = _train(paratrain.SingleDeviceStrategy(device="cpu"), gpt2, data, None)
    runs = run_distributed(_pipelined, gpt2, data, None, world_size=4)
    block = {
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
    }
    expected = [  # stage 0's trace holds the tied weight under both its names
        {"transformer.wte.weight", "lm_head.weight", *(f"transformer.h.0.{n}" for n in block)},
        {*(f"transformer.h.1.{n}" for n in block), "lm_head.weight"},
    ]
    for rank, run in enumerate(runs):
        stage = rank // 2
        if stage == 1:
            assert run["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert run["test"] == pytest.approx(single["test"], rel=1e-5)
        assert _split(run["held"]) == expected[stage]
        for name, value in run["whole"].items():
            assert relative_difference(value.reshape(-1), single["whole"][name].reshape(-1)) < 1e-5, name


def _cli_gpt(cli, tmp_path, name, *flags, exit_code=0):
    """The built-in gpt on text-lm from the command line, 2 layers of width 32: its metrics
    and what it printed (where it exits ``exit_code`` 0; else None and what it reported)."""
    text = tmp_path / "text.txt"  # 64 sequences of 16 bytes, and a test tenth
    if not text.exists():
        text.write_bytes(bytes((7 * i + i // 97) % 251 for i in range(16 * 16 * 4 * 10 // 9 + 32)))
    out = tmp_path / f"{name}.json"
    result = cli(
        "train",
        "--model",
        "gpt",
        "--dataset",
        f"text-lm:{text}",
        "--seq-len",
        "16",
        "--epochs",
        "1",
        "--gpt-layers",
        "2",
        "--gpt-width",
        "32",
        "--gpt-heads",
        "4",
        "--gpt-dropout",
        "0",
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--lr",
        "0.1",
        "--metrics",
        "",
        "--no-progress",
        "--metrics-out",
        str(out),
        *flags,
    )
    assert result.returncode == exit_code, result.stderr[-3000:]
    return (json.loads(out.read_text()), result.stdout) if exit_code == 0 else (None, result.stderr)


@PACKED_TP
@pytest.mark.parametrize(("workers", "batch"), [(4, 8), (8, 16)], ids=["2x2", "2x2x2"])
def test_the_builtin_gpt_from_the_command_line_equals_single(cli, tmp_path, workers, batch):
    """``pipeline --stages 2 --tensor-parallel 2``: on 4 processes the training and test loss of
    ``single`` with the same batch; on 8 (2 replicas) the test loss of ``single`` with the
    global batch of both. The run prints its mesh's groups."""
    single, _ = _cli_gpt(cli, tmp_path, "single", "--batch-size", str(batch))
    mesh, printed = _cli_gpt(
        cli,
        tmp_path,
        "mesh",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--tensor-parallel",
        "2",
        "--workers",
        str(workers),
        "--batch-size",
        "8",
    )
    assert mesh["global_steps"] == single["global_steps"] == 64 // batch
    assert mesh["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
    if workers == 4:
        assert mesh["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        assert "tp groups [0, 1] [2, 3]; pp groups [0, 2] [1, 3]; dp groups [0] [1] [2] [3]" in printed
    else:
        groups = "tp groups [0, 1] [2, 3] [4, 5] [6, 7]; pp groups [0, 2] [1, 3] [4, 6] [5, 7]; dp groups [0, 4]"
        assert groups in printed and "2 replica(s) x 2 stages x 2 shards" in printed
    assert mesh["tensor_parallel"] == 2 and mesh["workers"] == workers


@PACKED_TP
def test_a_3d_run_resumes_from_its_checkpoint_as_if_never_stopped(cli, tmp_path):
    """2 stages x 2 shards with AdamW (its moments split as the parameters): one epoch with
    --checkpoint-dir, then --resume to the second, ends where two epochs straight end; each
    process's part holds its own shard. Another mesh is refused in one line, the checkpoint kept."""
    mesh = [
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--tensor-parallel",
        "2",
        "--workers",
        "4",
        "--batch-size",
        "8",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
    ]
    folder = tmp_path / "ck"
    _cli_gpt(cli, tmp_path, "first", *mesh, "--checkpoint-dir", str(folder))
    saved = torch.load(next(folder.glob("ckpt-*")) / "rank-1.pt", weights_only=True)
    assert saved["strategy"]["shard"] == [1, 2] and saved["strategy"]["stage"] == 0
    split = [v for k, v in saved["model"].items() if k.endswith("attention.qkv.weight")]
    assert split and all(not hasattr(v, "to_local") for v in split)  # plain tensors, this shard's part
    resumed, printed = _cli_gpt(
        cli, tmp_path, "resumed", *mesh, "--epochs", "2", "--checkpoint-dir", str(folder), "--resume"
    )
    assert "resumed from" in printed
    straight, _ = _cli_gpt(cli, tmp_path, "straight", *mesh, "--epochs", "2")
    assert resumed["global_steps"] == straight["global_steps"] == 2 * 64 // 8
    assert resumed["history"][-1]["test_loss"] == pytest.approx(straight["history"][-1]["test_loss"], rel=1e-6)
    assert resumed["test_loss"] == pytest.approx(straight["test_loss"], rel=1e-6)
    files = sorted(p.name for p in folder.rglob("*"))
    other = [*mesh[:7], "1", *mesh[8:], "--epochs", "3", "--checkpoint-dir", str(folder), "--resume"]
    _, said = _cli_gpt(cli, tmp_path, "other", *other, exit_code=2)  # 2 replicas of 2 stages: rank 1 is stage 1
    # whichever process reads a part that is not its own says so first: a stage or a shard
    assert re.search(
        r"checkpoint holds (stage \d|shard \d of 2 of stage \d), this process runs (stage \d|shard 0 of 1)", said
    ), said
    assert sorted(p.name for p in folder.rglob("*")) == files
