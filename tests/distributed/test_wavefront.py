"""The RNN wavefront: a stacked LSTM pipelined one layer per process over chunks of the
sequence gives the unsplit LSTM's outputs and gradients."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.wavefront import WavefrontStage, bubble, split_lstm
from paratrain.testing import run_distributed

pytestmark = pytest.mark.distributed

B = 4
T = 12
V = 30
F = 8
H = 16
CLASSES = 3


def _model(layers):
    torch.manual_seed(0)
    return nn.Embedding(V, F), nn.LSTM(F, H, num_layers=layers, batch_first=True), nn.Linear(H, CLASSES)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def _reference(layers):
    embedding, lstm, head = _model(layers)
    ids, labels = _data()
    out, _ = lstm(embedding(ids))
    nn.functional.cross_entropy(head(out[:, -1]), labels).backward()
    grads = [
        {n.replace(f"_l{k}", "_l0"): p.grad for n, p in lstm.named_parameters() if n.endswith(f"_l{k}")}
        for k in range(layers)
    ]
    return out.detach(), grads, embedding.weight.grad, head.weight.grad


def _stage(layers, chunks):
    dist.init_process_group("gloo")
    try:
        return _run_stage(dist.get_rank(), layers, chunks)
    finally:
        dist.destroy_process_group()


def _run_stage(rank, layers, chunks):
    embedding, lstm, head = _model(layers)
    ids, labels = _data()
    stage = WavefrontStage(split_lstm(lstm)[rank], rank, list(range(layers)), chunks)
    out = stage.forward(embedding(ids) if rank == 0 else None, B, T)
    result = {}
    if stage.is_last:
        leaf = out.detach().requires_grad_(True)
        nn.functional.cross_entropy(head(leaf[:, -1]), labels).backward()
        stage.backward(leaf.grad)
        result.update(out=out.detach(), head=head.weight.grad)
    else:
        stage.backward()
    result["layer"] = {n: p.grad for n, p in stage.layer.named_parameters()}
    if rank == 0:
        result["embedding"] = embedding.weight.grad
    return result


@pytest.mark.parametrize("layers, chunks", [(3, 4), (2, 1), (2, 12), (3, 5)])
def test_the_wavefront_gives_the_unsplit_lstms_outputs_and_gradients(layers, chunks):
    """``layers`` processes, one layer each; the 12 steps in ``chunks`` chunks (5: unequal
    ones; 12: one step a chunk; 1: no wave). Outputs, every layer's gradients, the
    embedding's (on the first stage) and the head's (on the last) equal the unsplit model's
    to float32 rounding."""
    out, grads, embedding, head = _reference(layers)
    results = run_distributed(_stage, layers, chunks, world_size=layers)
    assert torch.allclose(results[-1]["out"], out, atol=1e-6)
    assert torch.allclose(results[-1]["head"], head, atol=1e-6)
    assert torch.allclose(results[0]["embedding"], embedding, atol=1e-6)
    for k, result in enumerate(results):
        for name, grad in grads[k].items():
            assert torch.allclose(result["layer"][name], grad, atol=1e-6), (k, name)


def test_split_lstm_keeps_each_layers_weights_and_the_bubble_follows_the_formula():
    _, lstm, _ = _model(3)
    x = torch.randn(2, 5, F)
    out = x
    for layer in split_lstm(lstm):
        out, _ = layer(out)
    assert torch.allclose(out, lstm(x)[0], atol=1e-6)
    assert bubble(1, 8) == 0 and bubble(4, 1) == 0.75 and bubble(3, 8) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unidirectional"):
        split_lstm(nn.LSTM(2, 2, bidirectional=True, batch_first=True))


def _history(cli, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    result = cli(
        "train",
        "--model",
        "lstm",
        "--epochs",
        "2",
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
        *flags,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


# three stages and every chunking against the unsplit LSTM in one process: above
@pytest.mark.parametrize("stages, chunks", [(2, 4), pytest.param(3, 8, marks=pytest.mark.matrix)])
def test_the_wavefront_schedule_trains_a_stacked_lstm_as_one_process_does(cli, tmp_path, stages, chunks):
    """``--strategy pipeline --schedule wavefront``: the built-in LSTM classifier with one
    layer a stage, each row of the digits (8 time steps) in ``chunks`` chunks; every epoch's
    train and test loss equal one process's (momentum 0.9, the whole run)."""
    layers = ["--lstm-layers", str(stages)]
    single = _history(cli, tmp_path, "single", "--strategy", "single", *layers)
    wave = _history(
        cli,
        tmp_path,
        "wave",
        "--strategy",
        "pipeline",
        "--schedule",
        "wavefront",
        "--stages",
        str(stages),
        "--microbatches",
        str(chunks),
        *layers,
    )
    assert wave["workers"] == stages and wave["bytes_sent"] > 0
    for a, b in zip(wave["history"], single["history"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model", "mlp"], "Sequential has no wavefront_parts() (the built-in lstm model has"),
        (["--model", "lstm", "--lstm-layers", "3"], "the model has 3 layers, --stages is 2"),
        (["--model", "lstm", "--lstm-layers", "2", "--split-points", "1"], "drop --split-points and --balance"),
        (["--model", "lstm", "--lstm-layers", "2", "--strategy", "pipeline-ft"], "runs under --strategy pipeline"),
    ],
)
def test_a_model_the_wavefront_cannot_split_is_one_line(cli, flags, words):
    result = cli("train", "--strategy", "pipeline", "--schedule", "wavefront", "--stages", "2", *flags)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def _fit_lstm(strategy, steps=6, batch=16):
    import paratrain
    from paratrain.data.datasets import load_digits
    from paratrain.models.lstm_classifier import LSTMClassifier

    torch.manual_seed(0)
    splits = load_digits()
    model = LSTMClassifier(splits.spec, layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=strategy)
    x, y = splits.train.tensors
    history = trainer.fit((x[: steps * batch], y[: steps * batch]), epochs=2, batch_size=batch, verbose=0)
    losses = history.history.get("train_loss")
    strategy.teardown()
    return losses


def _wave_api():
    import paratrain

    return _fit_lstm(paratrain.PipelineStrategy(num_stages=2, schedule="wavefront", num_microbatches=3, device="cpu"))


def test_the_wavefront_from_the_python_api_equals_one_process():
    """PipelineStrategy(schedule="wavefront") on a user's script: the last stage's losses
    are one process's."""
    import paratrain

    single = _fit_lstm(paratrain.SingleDeviceStrategy(device="cpu"))
    wave = run_distributed(_wave_api, world_size=2)[1]
    assert wave == pytest.approx(single, rel=1e-5)


def test_wavefront_replicas_equal_one_process_and_a_resumed_run_the_whole_one(cli, tmp_path):
    """2 replicas x 2 stages equal one process of the global batch; a wavefront run stopped
    after 1 epoch and resumed to 2 ends as the run never stopped (its checkpoints are the
    pipeline's: each stage its part)."""
    wave = [
        "--strategy",
        "pipeline",
        "--schedule",
        "wavefront",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--lstm-layers",
        "2",
    ]
    one = ["--epochs", "1"]  # 22 steps of the global batch: a replica or stage misplaced shows at once
    single = _history(cli, tmp_path, "single", "--strategy", "single", "--lstm-layers", "2", "--batch-size", "64", *one)
    replicas = _history(cli, tmp_path, "replicas", *wave, "--workers", "4", *one)
    assert replicas["replicas"] == 2
    for a, b in zip(replicas["history"], single["history"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
    saving = [*wave, "--checkpoint-every", "15", "--checkpoint-dir", str(tmp_path / "ck")]
    whole = _history(cli, tmp_path, "whole", *wave)
    _history(cli, tmp_path, "first", *saving, *one)
    resumed = _history(cli, tmp_path, "resumed", *saving, "--resume")
    assert resumed["resumed_from_step"] == 44
    assert [e["test_loss"] for e in resumed["history"][-1:]] == [e["test_loss"] for e in whole["history"][-1:]]
    assert resumed["test_loss"] == whole["test_loss"]
