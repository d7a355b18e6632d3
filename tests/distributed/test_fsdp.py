"""fsdp (FSDP2 over Gloo) against the single-process reference, and its sharded checkpoints."""

import json
import shutil

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.testing import flat_parameters, relative_difference, run_distributed

pytestmark = pytest.mark.distributed

B, STEPS = 16, 12


def _train(strategy, batch_size, accumulate=1, optimizer="sgd", nan_at=None):
    torch.manual_seed(0)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:  # two parameter groups, one without weight decay: both must survive the rebuild
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.003)
    loss = "cross_entropy" if nan_at is None else _nan_at(nan_at, strategy)
    trainer = paratrain.Trainer(model, loss, opt, strategy=strategy, accumulate=accumulate)
    x, y = splits.train.tensors
    n = STEPS * batch_size * accumulate * strategy.num_replicas
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=0, verbose=0)
    assert trainer.global_step == STEPS
    module = trainer.module
    if isinstance(strategy, paratrain.FSDPStrategy):
        shards = [p.to_local().numel() for p in module.parameters()]
        full = torch.cat([p.detach().full_tensor().reshape(-1) for p in module.parameters()])
        groups = [len(g["params"]) for g in trainer.optimizer.param_groups]
        strategy.teardown()
        return full, shards, groups
    return flat_parameters(module)


def _nan_at(call, strategy):
    """Cross-entropy that is NaN at its ``call``-th evaluation on the last replica only."""
    calls = {"n": 0}

    def loss(logits, targets):
        calls["n"] += 1
        value = torch.nn.functional.cross_entropy(logits, targets)
        return value * float("nan") if calls["n"] == call and strategy.rank == strategy.num_replicas - 1 else value

    return loss


def _fsdp(accumulate, optimizer, reshard, nan_at=None):
    strategy = paratrain.FSDPStrategy(device="cpu", reshard_after_forward=reshard)
    strategy.on_nan = "skip"
    result = _train(strategy, B, accumulate, optimizer, nan_at)
    return (*result, strategy.skipped_updates)


def test_on_nan_skip_skips_the_step_on_every_shard_as_single_does():
    """Replica 1's NaN at step 4 reaches every shard through the reduce-scatter: all skip
    that update, as one process of the global batch skips it."""
    single = paratrain.SingleDeviceStrategy(device="cpu")
    single.on_nan = "skip"
    reference = _train(single, 2 * B, nan_at=4)
    assert single.skipped_updates == 1
    for full, _, _, skipped in run_distributed(_fsdp, 1, "sgd", True, 4, world_size=2):
        assert skipped == 1
        assert relative_difference(full, reference) < 1e-5


@pytest.mark.parametrize(
    ("accumulate", "optimizer", "reshard"),
    [(1, "sgd", True), (2, "adamw", False)],
    ids=["zero3-sgd", "zero2-accumulate-adamw-groups"],
)
def test_fsdp_equals_single_with_the_global_batch(accumulate, optimizer, reshard):
    reference = _train(paratrain.SingleDeviceStrategy(device="cpu"), 2 * B, accumulate, optimizer)
    ranks = run_distributed(_fsdp, accumulate, optimizer, reshard, world_size=2)
    total = reference.numel()
    for full, shards, groups, _ in ranks:
        assert relative_difference(full, reference) < 1e-5
        assert sum(shards) <= total // 2 + 64  # each process holds about half of every parameter
        names = [n for n, _ in build_model("mlp", load_digits().spec).named_parameters()]
        weights = sum(n.endswith("weight") for n in names)
        assert groups == ([len(names)] if optimizer == "sgd" else [weights, len(names) - weights])


def _scorer(strategy):
    """A trainer of the mlp under ``strategy``, and digits' first 513 training examples."""
    torch.manual_seed(0)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=strategy, metrics=["accuracy"])
    x, y = splits.train.tensors
    return trainer, x[:513], y[:513]


def _evaluate_513(strategy):
    trainer, x, y = _scorer(strategy)
    return trainer.evaluate((x, y), batch_size=256)


def test_evaluation_of_a_set_that_splits_unevenly_over_the_shards_equals_single():
    # 257 and 256 examples: in batches of 256, one shard would take 2 forwards, the other 1
    # (each forward all-gathers: it hung until the collective's timeout); both take 2 now
    reference = _evaluate_513(paratrain.SingleDeviceStrategy(device="cpu"))
    for scores in run_distributed(_evaluate_513, paratrain.FSDPStrategy(device="cpu"), world_size=2):
        assert scores["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert scores["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-9)


class Batches:
    """Ready batches with no len(), as a streamed evaluation set gives them."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __iter__(self):
        return iter(self.pairs)


def _evaluate_stream(strategy):
    trainer, x, y = _scorer(strategy)
    return trainer.evaluate(Batches(list(zip(x.split(110), y.split(110), strict=True))))


def test_evaluation_of_a_stream_of_batches_that_splits_unevenly_over_the_shards_equals_single():
    # 5 batches on 2 shards: taken in turns, one shard would take 3 forwards and the other 2
    # (it hung); the last batch is split between them now, 3 each, every example once
    reference = _evaluate_stream(paratrain.SingleDeviceStrategy(device="cpu"))
    for scores in run_distributed(_evaluate_stream, paratrain.FSDPStrategy(device="cpu"), world_size=2):
        assert scores["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert scores["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-9)


class TiedLM(torch.nn.Module):
    """A language model whose output layer is its input embedding (as GPT-2's is)."""

    def __init__(self, vocab=40, dim=12):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _next_token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_tied(strategy, batch_size):
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = paratrain.Trainer(model, _next_token_loss, optimizer, strategy=strategy)
    rows = STEPS * batch_size * strategy.num_replicas  # the replicas are known once the Trainer is made
    tokens = torch.randint(0, 40, (rows, 9), generator=torch.Generator().manual_seed(1))
    trainer.fit((tokens[:, :-1], tokens[:, 1:]), epochs=1, batch_size=batch_size, seed=0, verbose=0)
    assert trainer.global_step == STEPS
    module = trainer.module
    tied = module.head.weight is module.embed.weight
    if isinstance(strategy, paratrain.FSDPStrategy):
        full = torch.cat([p.detach().full_tensor().reshape(-1) for p in module.parameters()])
        strategy.teardown()
        return full, tied
    return flat_parameters(module), tied


def _fsdp_tied():
    return _train_tied(paratrain.FSDPStrategy(device="cpu"), B)


def test_a_model_with_tied_embeddings_is_sharded_and_equals_single():
    """The output layer shares the embedding's weight: it is sharded once (with the root),
    stays shared, and training equals one process of the global batch."""
    reference, tied = _train_tied(paratrain.SingleDeviceStrategy(device="cpu"), 2 * B)
    assert tied
    for full, tied in run_distributed(_fsdp_tied, world_size=2):
        assert tied
        assert relative_difference(full, reference) < 1e-5


def _run(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = cli("train", "--strategy", "fsdp", "--log-every", "0", "--metrics-out", str(out), *args)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result


@pytest.mark.parametrize("saving", [[], ["--checkpoint-async"]], ids=["saved", "saved in the background"])
def test_sharded_checkpoints_resume_exactly_and_on_another_number_of_processes(cli, tmp_path, saving):
    """In the background (``--checkpoint-async``: DCP's async_save over a Gloo group of its
    own, every 10 steps while training goes on) as on the training thread."""
    ckpt = tmp_path / "ckpt"
    whole, _ = _run(cli, tmp_path, "whole", "--workers", "2", "--epochs", "4", "--compression", "bf16")
    assert whole["test_accuracy"] >= 0.9
    first, _ = _run(
        cli,
        tmp_path,
        "first",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--compression",
        "bf16",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "10",
        *saving,
    )
    for folder in sorted(ckpt.glob("ckpt-*")):  # every checkpoint kept names every shard's file
        manifest = json.loads((folder / "manifest.json").read_text())
        shard_files = sorted(name for name in manifest["parts"] if name.startswith("model/"))
        assert shard_files == ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp"], folder.name
    assert [p.name for p in sorted(ckpt.glob("ckpt-*"))][-1] == "ckpt-000000044"
    folder = ckpt / "ckpt-000000044"
    assert "model" not in torch.load(folder / "rank-0.pt", weights_only=True)  # no process held it whole
    shutil.copytree(ckpt, tmp_path / "copy")
    # The same number of processes: exactly the uninterrupted run.
    second, _ = _run(
        cli,
        tmp_path,
        "second",
        "--workers",
        "2",
        "--epochs",
        "4",
        "--compression",
        "bf16",
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        *saving,
    )
    assert second["resumed_from_step"] == 44
    assert second["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)
    # Three processes read the two shards: nothing left to train, the same model evaluated.
    resharded, result = _run(
        cli,
        tmp_path,
        "three",
        "--workers",
        "3",
        "--epochs",
        "2",
        "--compression",
        "bf16",
        "--checkpoint-dir",
        str(tmp_path / "copy"),
        "--resume",
    )
    assert "was written by 2 replicas, this run has 3: the model is resharded" in result.stdout
    assert resharded["test_loss"] == pytest.approx(first["test_loss"], rel=1e-5)


def test_a_corrupt_shard_is_one_line_and_nothing_is_deleted(cli, tmp_path):
    ckpt = tmp_path / "ckpt"
    _run(cli, tmp_path, "first", "--workers", "2", "--epochs", "1", "--checkpoint-dir", str(ckpt))
    shard = next(ckpt.glob("ckpt-*/model/__1_0.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size: only the checksum can tell
    before = sorted(p.name for p in ckpt.rglob("*"))
    result = cli(
        "train", "--strategy", "fsdp", "--workers", "2", "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume"
    )
    assert result.returncode == 2
    assert "model/__1_0.distcp: corrupt or truncated" in result.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in ckpt.rglob("*")) == before


def digits_cnn(spec):
    """A conv net for the 8x8 digits: on the CPU a conv net's default is channels-last order."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 64, 10)
    )


def test_a_conv_net_on_the_cpu_is_sharded_in_contiguous_order(cli, tmp_path):
    """FSDP2 shards only contiguous parameters: fsdp leaves channels-last off (the CPU's
    default for conv nets elsewhere) and refuses it when asked for."""
    out = tmp_path / "m.json"
    model = "tests.distributed.test_fsdp:digits_cnn"
    result = cli(
        "train",
        "--strategy",
        "fsdp",
        "--workers",
        "2",
        "--epochs",
        "1",
        "--model",
        model,
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["channels_last"] is False and metrics["test_accuracy"] > 0.5
    refused = cli("train", "--strategy", "fsdp", "--model", model, "--channels-last")
    assert refused.returncode == 2
    assert "--channels-last: --strategy fsdp shards parameters, which must be contiguous" in refused.stderr
