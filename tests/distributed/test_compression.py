"""Gradient codecs with allreduce on 2 Gloo processes, against the uncompressed reference."""

import copy
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import paratrain
from paratrain.comm.codec_config import CodecOptions, make_codec
from paratrain.comm.codecs import Int8Codec, TopKCodec
from paratrain.comm.error_feedback import ErrorFeedback
from paratrain.comm.hooks import make_hook
from paratrain.comm.transport import ensure_process_group
from paratrain.config import TrainConfig
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.session.teardown import destroy_groups, gloo_threads
from paratrain.testing import flat_parameters, run_distributed
from paratrain.train import job

pytestmark = pytest.mark.distributed

CODECS = ["none", "fp16", "bf16", "int8", "topk", "powersgd"]
MLP_PARAMETERS = 64 * 256 + 256 + 256 * 10 + 10


def _mlp(name="mlp"):
    torch.manual_seed(0)
    return build_model(name, load_digits().spec)


def _step_bytes(name):
    """Bytes one rank sends per step for the MLP, from the codecs' formulas."""
    hook = make_hook(make_codec(name))
    return 4 * MLP_PARAMETERS if hook is None else hook.step_bytes(_mlp())


# ----- the hooked averaged gradient against the unhooked one ------------------------------


def _hooked_and_reference_gradients(names, steps):
    """Per codec and step: this rank's local gradient, the hooked DDP's averaged one and
    the unhooked DDP's, on the same model and this rank's own 32 examples."""
    ensure_process_group("gloo", 60)
    rank = dist.get_rank()
    x, y = load_digits().train.tensors
    x, y = x[32 * rank : 32 * (rank + 1)], y[32 * rank : 32 * (rank + 1)]
    base, loss_fn = _mlp(), nn.CrossEntropyLoss()
    reference, local = DistributedDataParallel(copy.deepcopy(base)), copy.deepcopy(base)
    results = {}
    for name in names:
        strategy = paratrain.AllReduceStrategy(device="cpu", compression=name)
        model = copy.deepcopy(base)
        hooked, _ = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        records = []
        for _ in range(steps):
            record = {}
            for label, model in (("hooked", hooked), ("reference", reference), ("local", local)):
                model.zero_grad()
                loss_fn(model(x), y).backward()
                record[label] = {n: p.grad.clone() for n, p in strategy.unwrap(model).named_parameters()}
            records.append(record)
        results[name] = {"steps": records, "bytes_sent": strategy.hook.bytes_sent if strategy.hook else None}
    # The DDPs made here still hold the group: destroying it takes it out of them, so that its
    # Gloo threads end now (a group left to a reducer freed later, or to a peer's exit,
    # aborted this process once: "Resource deadlock avoided").
    destroy_groups()
    assert gloo_threads() == []
    return results


@pytest.fixture(scope="module")
def gradients():
    return run_distributed(_hooked_and_reference_gradients, CODECS, 3, world_size=2)


def _each_step(gradients, name):
    """(hooked, reference, [local of rank 0, local of rank 1]) per step, per parameter."""
    for step, (r0, r1) in enumerate(zip(gradients[0][name]["steps"], gradients[1][name]["steps"])):
        for p in r0["hooked"]:
            # the replicas must apply the very same update
            assert torch.equal(r0["hooked"][p], r1["hooked"][p]), (name, step, p)
            yield step, p, r0["hooked"][p], r0["reference"][p], [r0["local"][p], r1["local"][p]]


def test_none_is_ddps_own_all_reduce(gradients):
    assert gradients[0]["none"]["bytes_sent"] is None  # no hook at all
    for _, _, hooked, reference, _ in _each_step(gradients, "none"):
        assert torch.equal(hooked, reference)


@pytest.mark.parametrize("name, unit, smallest", [("fp16", 2.0**-11, 2.0**-24), ("bf16", 2.0**-8, 0.0)])
def test_half_precision_hook_matches_the_uncompressed_average(gradients, name, unit, smallest):
    for _, p, hooked, reference, (g0, g1) in _each_step(gradients, name):
        # two roundings (each half-gradient, then their sum), relative to the halves'
        # magnitudes, plus the spacing of fp16's subnormals near zero
        bound = 2 * unit * (g0.abs() + g1.abs()) / 2 * 1.01 + smallest + 1e-7 * reference.abs()
        assert bool(((hooked - reference).abs() <= bound).all()), p
    assert gradients[0][name]["bytes_sent"] == 3 * 2 * MLP_PARAMETERS


def _decode_then_average(codecs, locals_, key):
    """What the all-gather hook must compute: every rank's payload decoded, in rank order."""
    total = torch.zeros_like(locals_[0])
    for codec, g in zip(codecs, locals_):
        total.add_(codec.decompress(*codec.compress(g, key)))
    return total.div_(len(locals_))


@pytest.mark.parametrize("name, make", [("int8", Int8Codec), ("topk", lambda: ErrorFeedback(TopKCodec(0.01)))])
def test_all_gather_hook_decodes_then_averages(gradients, name, make):
    codecs = [make(), make()]  # one per rank: error feedback keeps each rank's own residual
    for step, p, hooked, reference, locals_ in _each_step(gradients, name):
        assert torch.equal(hooked, _decode_then_average(codecs, locals_, p)), (step, p)
        if name == "int8":  # half a quantization step per rank, at most
            assert (hooked - reference).norm() <= 0.01 * reference.norm()
    assert gradients[0][name]["bytes_sent"] == 3 * _step_bytes(name)


def test_topk_error_feedback_sends_everything_eventually(gradients):
    """Three steps of the same gradient: what was averaged plus the ranks' mean residual
    is three times the uncompressed average."""
    sent = {}
    for _, p, hooked, _reference, _ in _each_step(gradients, "topk"):
        sent[p] = sent.get(p, 0) + hooked
    residuals = [ErrorFeedback(TopKCodec(0.01)) for _ in range(2)]
    for step in range(3):
        for rank, codec in enumerate(residuals):
            for p, g in gradients[rank]["topk"]["steps"][step]["local"].items():
                codec.compress(g, p)
    for p, total in sent.items():
        owed = (residuals[0].residuals[p] + residuals[1].residuals[p]) / 2
        reference = gradients[0]["topk"]["steps"][0]["reference"][p]
        torch.testing.assert_close(total + owed, 3 * reference, rtol=1e-5, atol=1e-6)


def test_powersgd_hook_is_exact_until_it_starts_then_low_rank(gradients):
    for step, _p, hooked, reference, _ in _each_step(gradients, "powersgd"):
        if step < 2 or hooked.dim() == 1:  # plain all-reduce; vectors are never compressed
            torch.testing.assert_close(hooked, reference, rtol=1e-6, atol=1e-7)
        else:  # a projection of the (error-corrected) average: never larger an error than it
            assert 0 < (hooked - reference).norm() < reference.norm()
    assert gradients[0]["powersgd"]["bytes_sent"] == 2 * 4 * MLP_PARAMETERS + _step_bytes("powersgd")


# ----- every codec trains to the uncompressed accuracy --------------------------------------

# Top-k at 1% sends each entry about once per 100 steps: its run is long enough for that to
# converge, 30 epochs of 22 steps with the learning rate decayed 10x every 250 steps, so that
# the final accuracy is a settled value rather than one noisy epoch. The codecs that send
# every entry each step (16-bit, int8, PowerSGD's low-rank factors) settle in a third of it:
# 12 epochs, decayed every 90 steps. Each codec is held to the uncompressed run of its recipe.
RECIPE = dict(
    strategy="allreduce",
    workers=2,
    lr_schedule="exponential",
    seed=0,
    progress=False,
    log_every=0,
)
LONG, SHORT = dict(epochs=30, lr_decay_steps=250), dict(epochs=12, lr_decay_steps=90)


def _recipe(name):
    return LONG if name == "topk" else SHORT


def _train_every_codec(runs):
    ensure_process_group("gloo", 60)
    results = {}
    for name, recipe in runs:
        metrics = job.run(TrainConfig(compression=name, **RECIPE, **recipe))
        if "test_accuracy" in metrics:  # the chief's metrics document
            keys = ("test_accuracy", "bytes_sent", "bytes_per_step", "global_steps", "compression")
            results[name, recipe["epochs"]] = {k: metrics[k] for k in keys}
    destroy_groups()
    return results


def test_every_codec_reaches_the_uncompressed_accuracy():
    runs = [("none", LONG), ("none", SHORT)] + [(name, _recipe(name)) for name in CODECS if name != "none"]
    results = run_distributed(_train_every_codec, runs, world_size=2)[0]
    for name in CODECS:
        epochs = _recipe(name)["epochs"]
        baseline, result = results["none", epochs], results[name, epochs]
        assert baseline["test_accuracy"] >= 0.95
        steps = baseline["global_steps"]
        assert steps == result["global_steps"] == epochs * (1437 // 64)
        assert result["compression"] == name
        assert result["test_accuracy"] >= baseline["test_accuracy"] - 0.01, (name, result, baseline)
        # exact accounting: both ranks, every step, the formula's bytes
        full_steps = 2 if name == "powersgd" else 0  # PowerSGD's plain all-reduce steps
        expected = 2 * (full_steps * 4 * MLP_PARAMETERS + (steps - full_steps) * _step_bytes(name))
        assert result["bytes_sent"] == expected, name
        assert result["bytes_per_step"] == pytest.approx(expected / steps)
    per_step = {name: results[name, _recipe(name)["epochs"]]["bytes_per_step"] for name in CODECS}
    ratio = {name: per_step["none"] / per_step[name] for name in CODECS}
    assert ratio["fp16"] == ratio["bf16"] == 2.0
    assert ratio["int8"] >= 3.9 and ratio["topk"] >= 30


# ----- compressed state survives a checkpoint ----------------------------------------------


def _resume(names, directory):
    """Train 6 steps straight, and 3 steps then a checkpoint and 3 more in a fresh
    strategy, model and optimizer that load it; the parameters must be identical."""
    ensure_process_group("gloo", 60)
    rank = dist.get_rank()
    x, y = load_digits().train.tensors
    batches = [(x[64 * s + 32 * rank :][:32], y[64 * s + 32 * rank :][:32]) for s in range(6)]
    loss_fn = nn.CrossEntropyLoss()
    options = CodecOptions(compression_ratio=0.05, stochastic_rounding=True)
    results = {}
    for index, label in enumerate(names):
        # "powersgd@cifar_cnn": DDP puts all of a model's gradients in one bucket for
        # the first step, then rebuilds its buckets; the CNN's 1.1 MB of gradients with
        # 0.1 MB buckets make 4, so the saved state must be laid out anew twice.
        name, _, model_name = label.partition("@")

        def build():
            model = _mlp(model_name or "mlp")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            strategy = paratrain.AllReduceStrategy(
                device="cpu", compression=make_codec(name, options), bucket_cap_mb=0.1 if model_name else 25.0
            )
            return strategy, model, optimizer

        strategy, model, optimizer = build()
        model, optimizer = strategy.prepare(model, optimizer)
        for inputs, targets in batches[:3]:
            strategy.train_step(model, loss_fn, optimizer, inputs, targets)
        path = f"{directory}/{label}-rank{rank}.pt"
        torch.save(
            {
                "strategy": strategy.state_dict(),
                "model": strategy.unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
            },
            path,
        )
        for inputs, targets in batches[3:]:
            strategy.train_step(model, loss_fn, optimizer, inputs, targets)

        checkpoint = torch.load(path, weights_only=True)
        resumed, model_b, optimizer_b = build()
        model_b.load_state_dict(checkpoint["model"])
        optimizer_b.load_state_dict(checkpoint["optimizer"])
        if index % 2:  # the strategy's state may be loaded before or after prepare()
            resumed.load_state_dict(checkpoint["strategy"])
        model_b, optimizer_b = resumed.prepare(model_b, optimizer_b)
        if not index % 2:
            resumed.load_state_dict(checkpoint["strategy"])
        for inputs, targets in batches[3:]:
            resumed.train_step(model_b, loss_fn, optimizer_b, inputs, targets)
        results[label] = {
            "identical": torch.equal(flat_parameters(strategy.unwrap(model)), flat_parameters(resumed.unwrap(model_b))),
            "saved": sorted(checkpoint["strategy"]["hook"]),
            "buckets": len(getattr(strategy.hook, "layouts", {})),
            "codec": checkpoint["strategy"]["hook"].get("codec", {}),
            "q": checkpoint["strategy"]["hook"].get("q", {}),
            "bytes": (strategy.stats()["bytes_sent"], resumed.stats()["bytes_sent"]),
        }
    destroy_groups()
    return results


def test_compressed_state_survives_a_checkpoint(tmp_path):
    names = ["int8", "topk", "powersgd", "fp16", "powersgd@cifar_cnn"]
    ranks = run_distributed(_resume, names, str(tmp_path), world_size=2)
    for results in ranks:
        for name in names:
            assert results[name]["identical"], name
            assert results[name]["bytes"][0] == results[name]["bytes"][1], name
        assert results["int8"]["codec"]["counts"]  # stochastic rounding: draws per parameter
        assert set(results["topk"]["codec"]["residuals"]) == {"1.weight", "1.bias", "3.weight", "3.bias"}
        assert set(results["powersgd"]["q"]) == {"1.weight", "3.weight"}  # per parameter
        assert set(results["powersgd@cifar_cnn"]["q"]) == {"0.weight", "4.weight", "9.weight", "11.weight", "13.weight"}
        assert results["powersgd@cifar_cnn"]["buckets"] > 1
        assert "error" in results["powersgd"]["saved"]
    # residuals are each rank's own
    r0, r1 = (r["topk"]["codec"]["residuals"]["3.weight"] for r in ranks)
    assert not torch.equal(r0, r1)


def test_a_checkpoint_of_another_codec_is_bad_input():
    strategy = paratrain.AllReduceStrategy(device="cpu", compression="topk")
    state = {"name": "allreduce", "steps": 3, "compression": "int8", "hook": {}}
    with pytest.raises(
        paratrain.ConfigError, match="written with --compression int8, this run uses --compression topk"
    ):
        strategy.load_state_dict(state)


# ----- the command line ----------------------------------------------------------------------


def test_cli_int8_two_workers(cli, tmp_path):
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--compression",
        "int8",
        "--epochs",
        "2",
        "--no-progress",
        "--metrics-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["compression"] == "int8" and metrics["config"]["compression"] == "int8"
    steps = metrics["global_steps"]
    per_rank = MLP_PARAMETERS + 4 * sum(math.ceil(n / 256) for n in (64 * 256, 256, 256 * 10, 10))
    assert metrics["bytes_sent"] == 2 * steps * per_rank
    assert metrics["bytes_per_step"] == 2 * per_rank


# ----- with the parameter server: compressed pushes (and 16-bit pulls) -----------------------

PS_RECIPE = {**RECIPE, "strategy": "ps-sync"}


def _train_ps_every_codec(runs):
    from paratrain.strategies.ps.strategy import ParameterServerStrategy  # noqa: F401

    ensure_process_group("gloo", 60)
    results = {}
    for name, pull, recipe in runs:
        metrics = job.run(TrainConfig(compression=name, pull_compression=pull, **PS_RECIPE, **recipe))
        if "test_accuracy" in metrics:
            keys = ("test_accuracy", "bytes_sent", "global_steps", "compression", "pull_compression")
            results[f"{name}/{pull}", recipe["epochs"]] = {k: metrics[k] for k in keys}
    destroy_groups()
    return results


def test_every_codec_on_ps_sync_reaches_the_uncompressed_accuracy():
    # Each codec once, each pull dtype once: the push path is the same for every codec
    # (compress on the worker, decode on the shard), so pairing them halves the runs. Each
    # against the uncompressed run of its recipe (top-k's is the long one).
    pairs = [("fp16", "bf16"), ("bf16", "fp16"), ("int8", "none"), ("topk", "none"), ("powersgd", "none")]
    runs = [("none", "none", LONG), ("none", "none", SHORT)] + [(*pair, _recipe(pair[0])) for pair in pairs]
    results = next(r for r in run_distributed(_train_ps_every_codec, runs, world_size=3) if r)
    for (key, epochs), result in results.items():
        baseline = results["none/none", epochs]
        assert baseline["test_accuracy"] >= 0.95
        assert result["test_accuracy"] >= baseline["test_accuracy"] - 0.01, (key, result, baseline)
        assert result["global_steps"] == baseline["global_steps"] == epochs * 22
        if key != "none/none":
            assert result["bytes_sent"] < baseline["bytes_sent"], key
    # 16-bit pulls halve the parameter traffic too
    assert results["fp16/bf16", 12]["bytes_sent"] < 0.6 * results["none/none", 12]["bytes_sent"]


def _ps_resume_codec_state(directory):
    """A ps-sync run with top-k and checkpoints, then a second that resumes it: what each
    worker's codec held right after resuming, and what its file said."""
    from paratrain.strategies.ps.strategy import ParameterServerStrategy

    resumed = {}
    original = ParameterServerStrategy.load_state_dict

    def recording(self, state):  # on a resumed worker: the state its file held, then its codec's
        original(self, state)
        if self.host is None:
            resumed["loaded"] = {k: v.clone() for k, v in self.codec.state_dict()["residuals"].items()}
            resumed["file"] = state

    ParameterServerStrategy.load_state_dict = recording
    ensure_process_group("gloo", 60)
    common = dict(PS_RECIPE, **LONG, compression="topk", checkpoint_dir=directory, checkpoint_every=10)
    job.run(TrainConfig(**{**common, "epochs": 1}))
    job.run(TrainConfig(**{**common, "epochs": 2, "resume": True}))
    destroy_groups()
    return resumed


def test_ps_workers_resume_their_error_feedback_residuals(tmp_path):
    ranks = run_distributed(_ps_resume_codec_state, str(tmp_path), world_size=3)
    workers = ranks[1:]
    for worker in workers:
        saved = worker["file"]
        assert saved["version"] == 22  # the end of the first run: 1 epoch of 22 rounds
        assert set(worker["loaded"]) == set(saved["codec"]["residuals"]) and worker["loaded"]
        for key, residual in worker["loaded"].items():
            assert residual.abs().sum() > 0
            assert torch.equal(residual, saved["codec"]["residuals"][key])
    # each worker resumed its own residuals
    assert not torch.equal(workers[0]["loaded"]["0.0"], workers[1]["loaded"]["0.0"])
    assert sorted(p.name for p in (tmp_path / "ckpt-000000030").iterdir()) == [
        "manifest.json",
        "shard-0.pt",
        "worker-0.pt",
        "worker-1.pt",
    ]
