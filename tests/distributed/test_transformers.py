"""A Hugging Face GPT-2 (built from a config: no download), its data as a
``datasets.Dataset`` of dict examples and its own loss, through the strategies against the
single-process reference: the synchronous ones equal one process of the global batch, the
periodic ones reach its loss."""

import json
import math
import re
import subprocess

import pytest
import torch

import paratrain
from paratrain.strategies.base import current_strategy
from paratrain.testing import flat_parameters, relative_difference, run_distributed
from tests.conftest import PACKED_TP, REPO, TRACED_PIPELINE, torchrun_on_loopback

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

B = 8
STEPS = 6
SEQ = 16


def gpt2():
    """A 2-layer GPT-2 whose output layer is tied to its input embedding; no dropout, so
    that runs can be compared to the bit's rounding."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def tokens(examples):
    """Dict examples as a tokenizer and ``datasets`` make them, labels the inputs: counting
    on from a random token (mod 64), which a model learns in a few steps."""
    start = torch.randint(0, 64, (examples, 1), generator=torch.Generator().manual_seed(1))
    ids = ((start + torch.arange(SEQ)) % 64).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ] * examples, "labels": ids})


def optimizer_for(model, name):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(strategy, batch_size, optimizer="sgd", epochs=1):
    model = gpt2()
    opt = optimizer_for(model, optimizer)
    trainer = paratrain.Trainer(model, optimizer=opt, strategy=strategy, metrics=())  # the model's own loss
    data = tokens(STEPS * batch_size * strategy.num_replicas)
    history = trainer.fit(data, epochs=epochs, batch_size=batch_size, seed=0, verbose=0)
    module = trainer.module
    if isinstance(strategy, paratrain.FSDPStrategy):
        params = torch.cat([p.detach().full_tensor().reshape(-1) for p in module.parameters()])
    else:
        params = flat_parameters(module) if strategy.is_chief else None
    losses = history.history.get("train_loss") or [None]  # a parameter-server shard trains none
    result = (params, losses[-1], module.lm_head.weight is module.transformer.wte.weight)
    strategy.teardown()
    return result


def _distributed(name, optimizer, epochs):
    strategy = {
        "allreduce": lambda: paratrain.AllReduceStrategy(device="cpu"),
        "fsdp": lambda: paratrain.FSDPStrategy(device="cpu"),
        "ps-sync": lambda: paratrain.ParameterServerStrategy("sync", device="cpu"),
        "ps-async": lambda: paratrain.ParameterServerStrategy("async", device="cpu"),
        "ps-backup": lambda: paratrain.ParameterServerStrategy("backup", backup_workers=1, device="cpu"),
        "local-sgd": lambda: paratrain.LocalSGDStrategy(device="cpu", sync_every=3),
        "diloco": lambda: paratrain.DiLoCoStrategy(device="cpu", sync_every=3),
    }[name]()
    return _train(strategy, B, optimizer, epochs)


@pytest.mark.parametrize("name", ["allreduce", "fsdp", "ps-sync"])
def test_a_gpt2_under_a_synchronous_strategy_equals_one_process(name):
    reference, _, tied = _train(paratrain.SingleDeviceStrategy(device="cpu"), 2 * B)
    assert tied
    world = 3 if name == "ps-sync" else 2
    chief = [r for r in run_distributed(_distributed, name, "sgd", 1, world_size=world) if r[0] is not None]
    for params, _, tied in chief:
        assert tied  # the output layer still is the embedding
        assert relative_difference(params, reference) < 1e-5


@pytest.mark.parametrize("name", ["local-sgd", "diloco"])
def test_a_gpt2_under_periodic_averaging_reaches_the_loss_of_one_process(name):
    """AdamW: replicas that average every 3 steps end near one process's training loss."""
    _, single, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), 2 * B, "adamw", epochs=5)
    print(f"{name}: single's last epoch loss {single:.3f}")
    assert single < 3.0  # from ln 64 = 4.16: it learns
    for _, loss, _ in run_distributed(_distributed, name, "adamw", 5, world_size=2):
        print(f"{name}: a replica's last epoch loss {loss:.3f}")
        assert loss < single + 0.3


def _in_scope(batch_size, optimizer, epochs):
    """In each process of ``paratrain.launch(..., strategy=s)``: train under ``s``."""
    return _train(current_strategy(), batch_size, optimizer, epochs)


@pytest.mark.parametrize("name", ["allreduce-ft", "local-sgd-ft", "fsdp-ft"])
def test_a_gpt2_under_a_fault_tolerant_strategy_equals_one_process(name):
    """Two fault-tolerant replicas (torchft's Manager, a Lighthouse), each computing half of
    every global batch of dict examples, weighted and summed over the quorum (the gradient;
    local-sgd-ft averaging every step: the step's deltas): one process's parameters with the
    global batch, up to the order of float sums."""
    pytest.importorskip("torchft")
    reference, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), 2 * B)
    if name == "allreduce-ft":
        strategy = paratrain.FaultTolerantAllReduceStrategy(workers=2, device="cpu")
    elif name == "local-sgd-ft":
        strategy = paratrain.FaultTolerantLocalSGDStrategy(workers=2, device="cpu", sync_every=1)
    else:  # FSDP2 inside each replica (of one process here: the GPT-2's tied weight through it)
        strategy = paratrain.FaultTolerantFSDPStrategy(shards=1, workers=2, device="cpu")
    results = paratrain.launch(_in_scope, B, "sgd", 1, strategy=strategy)
    chiefs = [r for r in results if r[0] is not None]
    assert chiefs and all(tied for _, _, tied in results)
    for params, _, _ in chiefs:
        assert relative_difference(params, reference) < 1e-5


def test_a_gpt2_under_ps_async_with_one_worker_equals_one_process():
    """One worker: every gradient applied in turn, as one process steps. AdamW on the shard
    (rebuilt from the user's), the tied embedding held once: the same parameters."""
    reference, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B, "adamw")
    (_, _, _), (params, _, tied) = run_distributed(_distributed, "ps-async", "adamw", 1, world_size=2)
    assert tied and relative_difference(params, reference) < 1e-5


@pytest.mark.parametrize(("name", "world"), [("ps-async", 3), ("ps-backup", 4)])
def test_a_gpt2_under_an_asynchronous_parameter_server_learns(name, world):
    """Several workers: gradients applied as they come (ps-backup: a round takes the first 2
    of 3 workers'), each computed on parameters up to a few versions old. Measured here: a
    ps-async worker's last epoch ends anywhere in 0.43-1.44 (8 runs beside 3 busy processes:
    the order in which the workers' gradients arrive moves Adam's path; one process with the
    same batches per update: 0.62), a ps-backup worker's at ~0.43 (one process with a round's
    batch: 0.45), from ln 64 = 4.16 at the start. No bound of what staleness costs is exact,
    so the test asks that every worker learns (its loss under half the untrained model's),
    its output layer still the embedding."""
    workers = [r for r in run_distributed(_distributed, name, "adamw", 5, world_size=world) if r[1] is not None]
    assert len(workers) == world - 1
    for _, loss, tied in workers:
        print(f"{name}: a worker's last epoch loss {loss:.3f}")
        assert tied and loss < math.log(64) / 2


def _evaluate_streamed(strategy):
    """The GPT-2's own loss over a ``datasets`` stream: an IterableDataset of 43 dict
    examples through a DataLoader of 8 (5 full batches and one of 3), with no ``len()``."""
    model = gpt2()
    trainer = paratrain.Trainer(model, optimizer=optimizer_for(model, "sgd"), strategy=strategy, metrics=())
    stream = tokens(43).to_iterable_dataset().with_format("torch")
    scores = trainer.evaluate(torch.utils.data.DataLoader(stream, batch_size=8))
    strategy.teardown()
    return scores


def test_a_gpt2_evaluated_on_a_datasets_stream_under_fsdp_equals_one_process():
    """6 batches on 2 shards: 3 each, the last round's batches split between them (pieces
    of 2 and 1 examples of a dict batch). The model's loss is a mean over the same number of
    tokens in every example, so the example-weighted mean of the pieces' losses is one
    process's, up to float sums."""
    reference = _evaluate_streamed(paratrain.SingleDeviceStrategy(device="cpu"))
    assert math.log(64) - 1 < reference["loss"] < math.log(64) + 1  # untrained: near ln 64
    for scores in run_distributed(_evaluate_streamed, paratrain.FSDPStrategy(device="cpu"), world_size=2):
        assert scores["loss"] == pytest.approx(reference["loss"], rel=1e-6)


PROJECT = """
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel


def model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def _counting(starts):
    ids = [[(s + i) % 64 for i in range(16)] for s in starts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 16] * len(ids), "labels": ids})


def data():
    return {"train": _counting(range(0, 64)), "test": _counting(range(3, 67, 4))}
"""


def test_a_gpt2_and_its_dataset_train_from_the_command_line(cli, tmp_path):
    """--model and --dataset name the user's transformers model and datasets.Dataset; fsdp
    shards the tied model, the model's own loss trains it (from ln 64 = 4.16)."""
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
        "fsdp",
        "--workers",
        "2",
        "--metrics-out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["global_steps"] == 4 * 64 // 16 and metrics["test_loss"] < 2.5


@pytest.mark.parametrize("way", ["", "--checkpoint-async"], ids=["saved", "saved in the background"])
def test_a_gpt2_with_dropout_resumes_exactly_from_the_command_line(cli, tmp_path, way):
    """allreduce on 2 workers with AdamW (GPT-2's dropout on, its data a datasets.Dataset read
    through a DataLoader) saves every 2 steps; a run resumed from the last checkpoint for 2
    more epochs ends with the test loss of one never stopped, and the saved part holds the
    tied embedding once (one storage for wte and lm_head)."""
    (tmp_path / "hfgpt.py").write_text(PROJECT)
    flags = [
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
        "--batch-size",
        "8",
        "--no-progress",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
    ]
    saves = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", *([way] if way else [])]
    losses = {}
    for name, extra in [
        ("whole", ["--epochs", "4"]),
        ("first half", ["--epochs", "2", *saves]),
        ("resumed", ["--epochs", "4", *saves, "--resume"]),
    ]:
        out = tmp_path / f"{name}.json"
        result = cli("train", *flags, *extra, "--metrics-out", str(out), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = json.loads(out.read_text())["test_loss"]
        if name == "first half":
            part = torch.load(tmp_path / "ckpt" / "ckpt-000000008" / "rank-0.pt", weights_only=True)
            wte, head = part["model"]["transformer.wte.weight"], part["model"]["lm_head.weight"]
            assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    assert "resumed from" in result.stdout + result.stderr
    assert losses["resumed"] == pytest.approx(losses["whole"], rel=1e-6), losses


@pytest.mark.parametrize(
    "flags, processes",
    [
        (["--strategy", "fsdp"], 2),
        # a GPT-2 under ps-sync, pipeline and tensor: test_transformers, test_pipeline_transformers, test_tensor_parallel
        pytest.param(["--strategy", "ps-sync"], 3, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "pipeline"], 2, marks=[TRACED_PIPELINE, pytest.mark.matrix]),
        pytest.param(["--strategy", "tensor"], 2, marks=[PACKED_TP, pytest.mark.matrix]),
    ],
)
def test_the_documented_gpt2_script_runs_under_torchrun(tmp_path, flags, processes):
    """The transformers script of docs/user_code.md, verbatim: every process exits 0 and the
    workers learn to count on (from ln 64 = 4.16)."""
    script = tmp_path / "gpt2.py"
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "user_code.md").read_text(), re.DOTALL)
    scripts = [block for block in blocks if "GPT2LMHeadModel" in block and "strategy_from_flags" in block]
    assert scripts, "docs/user_code.md gives no GPT-2 script that takes the strategy from its flags"
    script.write_text(scripts[0])
    command = torchrun_on_loopback(processes, str(script), *flags)
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"last epoch's loss \[([0-9.]+)\]", result.stdout)]
    assert len(losses) == 2 and max(losses) < 2.0  # the workers (a shard trains none)


def _with_tables(table_sharding):
    strategy = paratrain.ParameterServerStrategy(
        "sync", num_shards=2, device="cpu", tables="all", table_sharding=table_sharding
    )
    model = gpt2()
    trainer = paratrain.Trainer(model, optimizer=optimizer_for(model, "sgd"), strategy=strategy, metrics=())
    trainer.fit(tokens(STEPS * B * 2), epochs=1, batch_size=B, seed=0, verbose=0)
    result = None
    if strategy.is_chief:
        named = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        result = (
            named,
            strategy.worker.tables.read("transformer.wpe"),
            trainer.module.lm_head.weight is model.transformer.wte.weight,
        )
    strategy.teardown()
    return result


@pytest.mark.parametrize("table_sharding", ["mod", "range"])
def test_a_gpt2_with_its_position_embedding_as_a_table_equals_one_process(table_sharding):
    """``--tables all`` on a GPT-2 takes the position embedding (its word embedding is tied
    to the output layer, which reads it whole: it stays dense) onto 2 shards by rows; with
    SGD the run equals one process of the global batch, the table to float32 rounding."""
    model = gpt2()
    trainer = paratrain.Trainer(
        model, optimizer=optimizer_for(model, "sgd"), strategy=paratrain.SingleDeviceStrategy(device="cpu"), metrics=()
    )
    trainer.fit(tokens(STEPS * 2 * B), epochs=1, batch_size=2 * B, seed=0, verbose=0)
    reference = {n: p.detach() for n, p in trainer.module.named_parameters()}
    named, wpe, tied = run_distributed(_with_tables, table_sharding, world_size=4)[2]
    assert tied and "transformer.wpe.weight" not in named
    dense = torch.cat([named[n].reshape(-1) for n in named])
    assert relative_difference(dense, torch.cat([reference[n].reshape(-1) for n in named])) < 1e-5
    assert relative_difference(wpe, reference["transformer.wpe.weight"]) < 1e-5
