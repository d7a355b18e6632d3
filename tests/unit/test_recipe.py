"""StepRecipe on one process: gradient accumulation, clipping, bf16/fp16, channels_last,
and the refusal of bad values (Python and CLI)."""

import copy
import warnings

import pytest
import torch

import paratrain
from paratrain.data.datasets import DataSpec, load_digits
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.strategies.recipe import StepRecipe
from paratrain.testing import flat_parameters, relative_difference

# Equal runs differ only in the order float32 sums are taken (a batch's mean gradient as
# one sum of 32 terms or as 4 weighted sums of 8, examples in another order): a few ulps
# (~1e-7 relative) per step, which a dozen SGD steps keep well below 1e-5.
TOLERANCE = 1e-5


def _single():
    return paratrain.SingleDeviceStrategy(device="cpu")


def _digits_trainer(seed=0, lr=0.1, momentum=0.0, **recipe):
    torch.manual_seed(seed)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=_single(), **recipe)
    return trainer, splits


def _initial_mlp(seed=0):
    torch.manual_seed(seed)
    return build_model("mlp", load_digits().spec)


# ----- accumulation ---------------------------------------------------------------------


def _steps(batch_size, steps, accumulate):
    """``steps`` optimizer steps of plain SGD, each on ``batch_size x accumulate`` examples."""
    trainer, splits = _digits_trainer(accumulate=accumulate)
    x, y = splits.train.tensors
    n = steps * batch_size * accumulate
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=0, verbose=0)
    assert trainer.global_step == steps
    assert trainer.examples_seen == n
    return flat_parameters(trainer.module)


def test_accumulating_four_batches_of_8_equals_one_batch_of_32():
    k = 12
    accumulated = _steps(8, k, accumulate=4)
    reference = _steps(32, k, accumulate=1)
    assert relative_difference(accumulated, reference) < TOLERANCE
    # the runs moved the parameters far beyond that tolerance
    assert relative_difference(flat_parameters(_initial_mlp()), reference) > 1e-2
    # and K steps of batch 8 without accumulation are another run altogether
    assert relative_difference(_steps(8, k, accumulate=1), reference) > 100 * TOLERANCE


def test_accumulation_weights_each_micro_batch_by_its_examples():
    """A batch that does not divide (10 examples in 4 slices of 3, 3, 2, 2): the gradient is
    still the whole batch's mean, and so is the loss reported."""
    torch.manual_seed(0)
    splits = load_digits()
    x, y = splits.train.tensors[0][:10], splits.train.tensors[1][:10]
    model = build_model("mlp", splits.spec)
    reference = copy.deepcopy(model)
    strategy = _single()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = strategy.prepare(model, optimizer, StepRecipe(accumulate=4))
    out = strategy.train_step(model, torch.nn.functional.cross_entropy, optimizer, x, y)
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    assert relative_difference(got, want) < TOLERANCE
    assert float(out.loss) == pytest.approx(loss.item(), rel=TOLERANCE)
    assert out.logits.shape == (10, 10)


# ----- clipping -------------------------------------------------------------------------


def test_clip_grad_norm_equals_torch_clip_grad_norm():
    max_norm, lr = 0.5, 1.0
    trainer, splits = _digits_trainer(lr=lr, clip_grad_norm=max_norm)
    by_hand = _initial_mlp()  # the same initial parameters
    assert torch.equal(flat_parameters(by_hand), flat_parameters(trainer.module))
    unclipped = copy.deepcopy(by_hand)
    x, y = splits.train.tensors[0][:32], splits.train.tensors[1][:32]

    trainer.fit((x, y), epochs=1, batch_size=32, verbose=0)
    assert trainer.global_step == 1

    optimizer = torch.optim.SGD(by_hand.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(by_hand(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(by_hand.parameters(), max_norm)
    optimizer.step()
    assert norm > 2 * max_norm  # clipping is active: the test can tell clipped from not

    got, want = flat_parameters(trainer.module), flat_parameters(by_hand)
    assert relative_difference(got, want) < TOLERANCE

    # the unclipped step lands elsewhere, far beyond the tolerance
    optimizer = torch.optim.SGD(unclipped.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(unclipped(x), y).backward()
    optimizer.step()
    assert relative_difference(flat_parameters(unclipped), want) > 100 * TOLERANCE


# ----- precision ------------------------------------------------------------------------


def _fit_digits(epochs, **recipe):
    trainer, splits = _digits_trainer(lr=0.05, momentum=0.9, **recipe)
    history = trainer.fit(splits.train, epochs=epochs, validation_data=splits.test, verbose=0)
    return trainer, history, splits


def test_bf16_on_the_cpu_learns_as_fp32_does_and_keeps_float32_parameters():
    _, fp32, _ = _fit_digits(3)
    trainer, bf16, splits = _fit_digits(3, precision="bf16")
    assert trainer.strategy.scaler is None  # bf16 needs no scaler
    assert all(p.dtype == torch.float32 for p in trainer.module.parameters())
    # the forward pass does run in bfloat16
    x = splits.test.tensors[0][:4]
    assert trainer.strategy.forward(trainer.module, x).dtype == torch.bfloat16
    assert fp32["test_accuracy"][-1] >= 0.9
    assert abs(bf16["test_accuracy"][-1] - fp32["test_accuracy"][-1]) <= 0.03
    assert bf16["train_loss"][-1] < bf16["train_loss"][0]


def _cpu_fp16_autocast_works():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns and disables autocast for an unsupported dtype
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                out = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
            torch.amp.GradScaler("cpu")
    except (RuntimeError, UserWarning, ValueError):
        return False
    return out.dtype == torch.float16


@pytest.mark.skipif(
    not _cpu_fp16_autocast_works(),
    reason=f"torch {torch.__version__}: CPU autocast does not support float16 (or GradScaler('cpu') is missing)",
)
def test_fp16_on_the_cpu_uses_a_grad_scaler_and_learns():
    trainer, history, splits = _fit_digits(2, precision="fp16")
    assert isinstance(trainer.strategy.scaler, torch.amp.GradScaler)
    assert trainer.strategy.scaler.is_enabled()
    assert trainer.strategy.scaler.get_scale() > 0
    assert all(p.dtype == torch.float32 for p in trainer.module.parameters())
    x = splits.test.tensors[0][:4]
    assert trainer.strategy.forward(trainer.module, x).dtype == torch.float16
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["test_accuracy"][-1] >= 0.8


def test_fp32_has_no_scaler():
    trainer, _ = _digits_trainer()
    assert trainer.strategy.scaler is None


# ----- channels_last --------------------------------------------------------------------

CIFAR_SPEC = DataSpec(input_shape=(3, 32, 32), num_classes=10)


def _cifar_step(channels_last):
    torch.manual_seed(0)
    model = build_model("cifar_cnn", CIFAR_SPEC)
    initial = flat_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=_single(), channels_last=channels_last)
    convs = [p for p in trainer.module.parameters() if p.dim() == 4]
    layouts = [(p.is_contiguous(memory_format=torch.channels_last), p.is_contiguous()) for p in convs]
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(8, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (8,), generator=generator)
    trainer.fit((x, y), epochs=1, batch_size=8, verbose=0)
    assert trainer.global_step == 1
    after = [p.is_contiguous(memory_format=torch.channels_last) for p in trainer.module.parameters() if p.dim() == 4]
    return initial, flat_parameters(trainer.module), layouts, after


def test_the_trainer_chooses_channels_last_for_a_conv_net_on_the_cpu_unless_told():
    """The Python API's default is the command line's: on for a conv net on the CPU, off for
    a model without 2-d convolutions; an explicit False or True is kept."""
    spec = load_digits().spec

    def chosen(name, spec, **given):
        model = build_model(name, spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return paratrain.Trainer(model, "cross_entropy", optimizer, strategy=_single(), **given).recipe.channels_last

    assert chosen("cifar_cnn", CIFAR_SPEC) is True
    assert chosen("cifar_cnn", CIFAR_SPEC, channels_last=False) is False
    assert chosen("mlp", spec) is False and chosen("mlp", spec, channels_last=True) is True


def test_channels_last_conv_weights_and_the_same_step():
    initial, plain, plain_layouts, _ = _cifar_step(channels_last=False)
    initial_cl, nhwc, layouts, after = _cifar_step(channels_last=True)
    assert torch.equal(initial, initial_cl)
    assert len(layouts) == 2
    # every 4-d weight is NHWC (and so no longer NCHW-contiguous), before and after the step
    assert all(cl and not nchw for cl, nchw in layouts)
    assert all(after)
    assert all(nchw and not cl for cl, nchw in plain_layouts)
    # The same arithmetic in another memory order: oneDNN picks other convolution kernels,
    # which sum in another order (float32 rounding, ~1e-6 relative per layer, compounded
    # through 2 convs, LRN and 3 dense layers). 1e-4 on the update leaves a wide margin.
    update, update_cl = plain - initial, nhwc - initial
    assert update.norm() > 1e-3 * initial.norm()
    assert relative_difference(update_cl, update) < 1e-4


# ----- bad values -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        ({"precision": "fp8"}, "precision"),
        ({"accumulate": 0}, "accumulate"),
        ({"accumulate": 2.0}, "accumulate"),
        ({"clip_grad_norm": -1}, "clip_grad_norm"),
        ({"clip_grad_norm": 0}, "clip_grad_norm"),
    ],
)
def test_step_recipe_refuses_bad_values(options, words):
    with pytest.raises(ConfigError, match=words):
        StepRecipe(**options)


def test_trainer_refuses_a_bad_recipe():
    model = build_model("mlp", load_digits().spec)
    with pytest.raises(ConfigError, match="accumulate"):
        paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), accumulate=0)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--accumulate", "0"], ["--accumulate"]),
        (["--precision", "fp8"], ["--precision", "fp8"]),
        (["--clip-grad-norm", "-1"], ["--clip-grad-norm"]),
        (["--strategy", "ps-sync", "--workers", "2", "--precision", "fp16"], ["--precision fp16", "ps-sync"]),
        (["--strategy", "pipeline", "--compile"], ["--compile", "pipeline"]),
    ],
)
def test_cli_refuses_bad_recipe_flags_with_one_line(cli, args, words):
    result = cli("train", "--epochs", "1", *args, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("paratrain: error: ")
    for word in words:
        assert word in lines[0]


@pytest.mark.slow
def test_compile_gives_the_eager_result_and_plain_state_dict_keys():
    """torch.compile changes kernels, not the math: 3 SGD steps of a small net agree with
    eager ones to float32 rounding (fused kernels sum in another order)."""

    def run(compile_model):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        trainer = paratrain.Trainer(
            model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.5), compile=compile_model
        )
        x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        trainer.fit((x, y), epochs=1, batch_size=32, verbose=0)
        return trainer

    eager, compiled = run(False), run(True)
    assert type(compiled.model).__name__ == "OptimizedModule"
    assert list(compiled.module.state_dict()) == list(eager.module.state_dict())  # no _orig_mod. prefix
    difference = relative_difference(flat_parameters(compiled.module), flat_parameters(eager.module))
    assert difference < 1e-5


@pytest.mark.parametrize("native", [True, False])
def test_a_precision_the_cpu_has_no_instructions_for_is_named_at_the_start(monkeypatch, capsys, native):
    """bf16 where the processor has no bfloat16 instructions runs PyTorch's reference
    convolutions and matrix products (many times float32's step): one line says so; where
    it has them, or in float32, nothing is said."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)

    def said(precision):
        model = build_model("mlp", load_digits().spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        paratrain.Trainer(  # onednn_layers's own line is tested in test_cpu_layers.py
            model,
            "cross_entropy",
            optimizer,
            strategy=_single(),
            precision=precision,
            cpu=paratrain.CpuTuning(onednn_layers=False),
        )
        return capsys.readouterr().out

    line = said("bf16")
    if native:
        assert line == ""
    else:
        assert line.count("\n") == 1 and "--precision bf16 on this CPU" in line and "slow reference path" in line
    assert said("fp32") == ""
