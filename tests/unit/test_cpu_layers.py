"""Linear layers through oneDNN and convolutions with their bias gradient apart
(strategies/cpu_layers.py): the same values and gradients as PyTorch's own kernels, within
float32's rounding of sums taken in another order (bit for bit where the kernel is the same
one); every case the fast path does not serve computes as the class it replaces."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.strategies import cpu_layers
from paratrain.strategies.cpu_layers import bias_apart_conv_forward, onednn_linear_forward, use_onednn_layers

pytestmark = pytest.mark.skipif(not cpu_layers.available(), reason="this PyTorch has no oneDNN")


def _served(module: nn.Module) -> str | None:
    """Which of the forward passes ``module`` runs: linear, conv, or None (its class's)."""
    function = getattr(vars(module).get("forward"), "func", None)
    return {onednn_linear_forward: "linear", bias_apart_conv_forward: "conv"}.get(function)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within float32 sums of a few thousand terms in another order: a relative error
    of about 1e-6 of the largest magnitude (the loss weighs every output positively, so a
    gradient's sum does not cancel below its terms); 1e-5 of it leaves room, and a wrong
    term (a missing bias, a transposed product) is off by far more."""
    assert actual.shape == expected.shape
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * scale)


def _grads(module: nn.Module, x: torch.Tensor, create_graph: bool = False) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = module(x)
    loss = (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum()
    return [out.detach(), *torch.autograd.grad(loss, [x, *module.parameters()], create_graph=create_graph)]


@pytest.mark.parametrize("shape", [(64, 96), (4, 7, 96), (0, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_linear_layer_through_onednn_gives_the_values_and_gradients_of_nn_linear(shape, bias):
    torch.manual_seed(0)
    stock = nn.Linear(96, 40, bias=bias)
    fast = copy.deepcopy(stock)
    use_onednn_layers(fast, linear=True)
    assert type(fast) is nn.Linear and _served(fast) == "linear"
    x = torch.randn(*shape)
    for got, want in zip(_grads(fast, x), _grads(stock, x)):
        _close(got, want)
    with torch.no_grad():  # evaluation: the forward product alone
        _close(fast(x), stock(x))


def test_a_tied_weight_gets_the_gradient_of_both_its_uses():
    torch.manual_seed(0)
    embedding, head = nn.Embedding(50, 32), nn.Linear(32, 50, bias=False)
    head.weight = embedding.weight  # a language model's tied input and output embeddings
    model = nn.Sequential(embedding, head)
    reference = copy.deepcopy(model)
    use_onednn_layers(model, linear=True)
    tokens = torch.randint(0, 50, (8, 12))
    for m in (model, reference):
        nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert model[1].weight is model[0].weight
    _close(model[0].weight.grad, reference[0].weight.grad)


def test_a_gradient_penalty_differentiates_the_backward_pass():
    """create_graph=True: the backward pass runs on differentiable products, so a penalty
    on the input gradient has the gradient it has with nn.Linear."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    fast = copy.deepcopy(stock)
    use_onednn_layers(fast, linear=True)
    x = torch.randn(20, 16)
    penalties = []
    for m in (fast, stock):
        xg = x.clone().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(m(xg).sum(), xg, create_graph=True)
        penalties.append(torch.autograd.grad(grad_x.pow(2).sum(), list(m.parameters())[:3]))  # not the last bias
    for got, want in zip(*penalties):
        _close(got, want)


@pytest.mark.parametrize(
    "padding, memory_format",
    [(2, torch.channels_last), (2, torch.contiguous_format), ("same", torch.channels_last), ("valid", None)],
)
def test_a_convolution_with_its_bias_gradient_apart_matches_conv2d(padding, memory_format):
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 16, 5, padding=padding)
    fast = copy.deepcopy(stock)
    use_onednn_layers(fast, linear=False)
    assert type(fast) is nn.Conv2d and _served(fast) == "conv"
    x = torch.randn(8, 3, 12, 12)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
        stock, fast = stock.to(memory_format=memory_format), fast.to(memory_format=memory_format)
    got, want = _grads(fast, x), _grads(stock, x)
    assert torch.equal(got[0], want[0])  # the same forward kernel
    assert torch.equal(got[2], want[2])  # the same weight-gradient kernel, without the bias
    _close(got[1], want[1])
    _close(got[3], want[3])  # the bias gradient: a sum in another order


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
def test_what_the_fast_path_does_not_serve_computes_as_the_class_it_replaces():
    torch.manual_seed(0)
    linear, conv = nn.Linear(8, 4), nn.Conv2d(2, 4, 4, padding="same")  # even kernel: more padding on one side
    reflect = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
    stock = [copy.deepcopy(m) for m in (linear, conv, reflect)]
    for m in (linear, conv, reflect):
        use_onednn_layers(m, linear=True)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(linear.double()(x), stock[0].double()(x))  # float64: PyTorch's own product
    image = torch.randn(2, 2, 6, 6)
    assert torch.equal(conv(image), stock[1](image)) and torch.equal(reflect(image), stock[2](image))
    plain = nn.Conv2d(2, 4, 3)
    plain_stock = copy.deepcopy(plain)
    use_onednn_layers(plain, linear=True)
    assert torch.equal(plain(image[0]), plain_stock(image[0]))  # one image, no batch dimension
    sparse = torch.eye(8).to_sparse()
    assert torch.equal(linear.float()(sparse), stock[0].float()(sparse))  # a sparse input: PyTorch's own product
    linear.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside PyTorch's own linear
        assert linear(x.float()).dtype == torch.bfloat16


class Mine(nn.Linear):
    """A user's own linear layer: its class stays."""


def test_only_modules_of_exactly_those_classes_change_and_they_keep_their_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3, bias=False), nn.Flatten(), Mine(4, 4), nn.Linear(4, 2))
    model[2].forward = lambda x: x.flatten(1)  # a forward of its own, set by another library: left alone
    own = model[2].forward
    keys = sorted(model.state_dict())
    use_onednn_layers(model, linear=True)
    assert [_served(m) for m in model] == ["conv", None, None, None, "linear"]
    assert model[2].forward is own
    assert [type(m) for m in model] == [nn.Conv2d, nn.Conv2d, nn.Flatten, Mine, nn.Linear]
    assert sorted(model.state_dict()) == keys
    del model[2].forward
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole module pickles and copies with its forward passes
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [_served(m) for m in copied] == ["conv", None, None, None, "linear"]
        assert copied[4].forward.args[0] is copied[4]  # bound to the copy, not the original
        x = torch.randn(2, 3, 5, 5)
        torch.testing.assert_close(copied(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "vendor, machine, linear",
    [("AuthenticAMD", "x86_64", True), ("GenuineIntel", "x86_64", False), (None, "arm64", False)],
)
def test_linear_layers_go_through_onednn_on_x86_processors_not_intels(monkeypatch, vendor, machine, linear):
    monkeypatch.setattr(cpu_layers, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_layers.platform, "machine", lambda: machine)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 2))
    use_onednn_layers(model, linear=None)
    assert [_served(m) for m in model] == ["conv", None, "linear" if linear else None]
    said = cpu_layers.describe(model, None)
    if linear:
        assert said == (
            "--onednn-layers: 1 linear layer(s) through oneDNN (MKL keeps its fastest paths for Intel's processors; "
            "this is AuthenticAMD); 1 convolution(s) with the bias gradient apart"
        )
    else:
        assert said == "--onednn-layers: 1 convolution(s) with the bias gradient apart"


def test_this_machines_vendor_is_read():
    assert cpu_layers.cpu_vendor() in (None, "GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls")


def _conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


def _fit(onednn_layers: bool | None, capsys: pytest.CaptureFixture) -> tuple[list[float], str, nn.Module]:
    model = _conv_net()
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        metrics=(),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
        cpu=paratrain.CpuTuning(onednn_layers=onednn_layers),
    )
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(256, 3, 16, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    )
    history = trainer.fit(data, epochs=3, batch_size=32, verbose=0, log_every=0)
    return [e["train_loss"] for e in history.epochs], capsys.readouterr().out, trainer.module


def test_the_trainer_trains_as_with_pytorchs_kernels_and_says_what_it_changed(capsys):
    """24 SGD steps with momentum: the two runs' losses part only by float32 rounding
    carried through the steps (1e-4 relative holds with a margin; a layer computing
    something else parts at the first step)."""
    on, said, module = _fit(True, capsys)
    off, said_off, module_off = _fit(False, capsys)
    assert "--onednn-layers: 2 linear layer(s) through oneDNN (as asked); 1 convolution(s)" in said
    assert "--onednn-layers" not in said_off
    assert _served(module[4]) == "linear" and _served(module_off[4]) is None
    assert on == pytest.approx(off, rel=1e-4)
    assert on[-1] < on[0]


def test_the_option_and_its_flag():
    assert TrainConfig().onednn_layers is None
    assert TrainConfig(onednn_layers=False).onednn_layers is False


def test_asked_for_on_a_gpu_it_is_refused():
    model = _conv_net()
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    strategy.setup()
    strategy.device = torch.device("cuda")  # as a CUDA run's strategy reports it
    with pytest.raises(ConfigError, match="--onednn-layers: oneDNN's kernels serve float32 CPU runs; this run's dev"):
        paratrain.Trainer(
            model,
            "cross_entropy",
            torch.optim.SGD(model.parameters(), lr=0.1),
            strategy=strategy,
            cpu=paratrain.CpuTuning(onednn_layers=True),
        )


def test_asked_for_under_autocast_it_is_refused_and_by_default_it_stays_off(capsys):
    model = _conv_net()
    with pytest.raises(ConfigError, match="float32 CPU runs; this run's precision is bf16"):
        paratrain.Trainer(
            model,
            "cross_entropy",
            torch.optim.SGD(model.parameters(), lr=0.1),
            strategy=paratrain.SingleDeviceStrategy(device="cpu"),
            precision="bf16",
            cpu=paratrain.CpuTuning(onednn_layers=True),
        )
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
        precision="bf16",
    )
    assert _served(trainer.module[4]) is None and "--onednn-layers" not in capsys.readouterr().out


def test_a_gpt2_from_transformers_trains_through_onednn_as_with_pytorchs_kernels():
    """GPT-2's linear layers are transformers' Conv1D (the weight kept as [in, out]) and its
    output layer an nn.Linear tied to the token embedding: all go through oneDNN, and a
    few AdamW steps on a dict batch part from PyTorch's kernels only by float32 rounding."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")

    def run(onednn_layers: bool) -> tuple[list[float], nn.Module]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(config)
        trainer = paratrain.Trainer(
            model,
            None,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            metrics=(),
            strategy=paratrain.SingleDeviceStrategy(device="cpu"),
            cpu=paratrain.CpuTuning(onednn_layers=onednn_layers),
        )
        ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(2)).tolist()
        data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
        history = trainer.fit(data, epochs=3, batch_size=16, verbose=0, log_every=0)
        return [e["train_loss"] for e in history.epochs], trainer.module

    on, module = run(True)
    off, _ = run(False)
    conv1d = [m for m in module.modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8 and all(_served(m) == "linear" for m in conv1d)  # 4 a block
    assert _served(module.lm_head) == "linear" and module.lm_head.weight is module.transformer.wte.weight
    assert on == pytest.approx(off, rel=1e-4)


def test_a_transformers_conv1d_through_onednn_gives_its_values_and_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    stock = transformers.pytorch_utils.Conv1D(40, 96)  # nf (out), nx (in): the weight is [96, 40]
    fast = copy.deepcopy(stock)
    use_onednn_layers(fast, linear=True)
    assert _served(fast) == "linear"
    x = torch.randn(4, 7, 96)
    got, want = _grads(fast, x), _grads(stock, x)
    assert got[2].shape == (96, 40) and got[2].is_contiguous()  # the gradient in the weight's own order
    for a, b in zip(got, want):
        _close(a, b)
