import pytest
import torch

from paratrain.data.datasets import DataSpec, load_digits
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.models.cifar_cnn import LocalResponseNorm

DIGITS = DataSpec((1, 8, 8), 10)
CIFAR = DataSpec((3, 32, 32), 10)
CIFAR_CROP = DataSpec((3, 24, 24), 10)
TEXT = DataSpec((40,), 2, input_kind="tokens", vocab_size=500)


@pytest.mark.parametrize(
    "name, spec",
    [
        ("mlp", DIGITS),
        ("mlp", CIFAR),
        ("cifar_cnn", DIGITS),
        ("cifar_cnn", CIFAR),
        ("cifar_cnn", CIFAR_CROP),
        ("lstm", DIGITS),
        ("lstm", TEXT),
    ],
)
def test_models_fit_their_data(name, spec):
    model = build_model(name, spec)
    dtype = torch.long if spec.input_kind == "tokens" else torch.float32
    out = model(torch.zeros((3, *spec.input_shape), dtype=dtype))
    assert out.shape == (3, spec.num_classes)


def test_mlp_is_the_tutorial_model():
    model = build_model("mlp", DataSpec((1, 28, 28), 10))
    assert [p.shape for p in model.parameters()] == [(256, 784), (256,), (10, 256), (10,)]


def test_cifar_cnn_is_the_tutorial_network():
    model = build_model("cifar_cnn", CIFAR_CROP)
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(6 * 6 * 64, 384), (384, 192), (192, 10)]
    lrn = [m for m in model if isinstance(m, LocalResponseNorm)]
    assert [(m.size, m.alpha, m.beta, m.k) for m in lrn] == [(9, 0.001, 0.75, 1.0)] * 2


def test_the_cifar_cnns_first_relu_after_its_pooling_is_the_tutorials_order():
    torch.manual_seed(0)
    model = build_model("cifar_cnn", CIFAR_CROP)
    assert isinstance(model[1], torch.nn.MaxPool2d) and isinstance(model[2], torch.nn.ReLU)
    tutorial = torch.nn.Sequential(model[0], model[2], model[1], *model[3:])
    x = torch.randn(8, *CIFAR_CROP.input_shape)
    ours, theirs = model(x), tutorial(x)
    assert torch.equal(ours, theirs)
    ours_grads = torch.autograd.grad(ours.square().sum(), list(model.parameters()))
    theirs_grads = torch.autograd.grad(theirs.square().sum(), list(tutorial.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ours_grads, theirs_grads, strict=True))


def test_a_model_that_does_not_fit_the_data_is_bad_input():
    with pytest.raises(ConfigError, match="model mlp needs image-like"):
        build_model("mlp", TEXT)


def test_digits_split_is_fixed_and_stratified():
    a, b = load_digits(), load_digits()
    assert len(a.train) + len(a.test) == 1797 and 355 <= len(a.test) <= 365
    assert torch.equal(a.test.tensors[1], b.test.tensors[1])
    counts = torch.bincount(a.test.tensors[1], minlength=10)
    assert counts.min() >= 35
    assert 0.0 <= float(a.train.tensors[0].min()) and float(a.train.tensors[0].max()) <= 1.0


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_cifar_cnns_local_response_norm_is_pytorchs(channels_last):
    torch.manual_seed(0)
    x = torch.randn(4, 64, 6, 6) * 3
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    ours, theirs = LocalResponseNorm(9, 0.001, 0.75, 1.0), torch.nn.LocalResponseNorm(9, 0.001, 0.75, 1.0)
    a, b = ours(x), theirs(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(a)
    (ga,) = torch.autograd.grad((a * weights).sum(), x)
    (gb,) = torch.autograd.grad((b * weights).sum(), x)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-6)
    # an even window (one more channel before than after: the backward's window is its mirror), another beta
    ours, theirs = LocalResponseNorm(4, 0.01, 0.5, 2.0), torch.nn.LocalResponseNorm(4, 0.01, 0.5, 2.0)
    a, b = ours(x), theirs(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    (ga,) = torch.autograd.grad((a * weights).sum(), x)
    (gb,) = torch.autograd.grad((b * weights).sum(), x)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-6)


def test_the_local_response_norms_backward_is_its_derivative():
    x = (torch.randn(2, 12, 3, 3, dtype=torch.float64) * 3).requires_grad_()
    for size, beta in ((9, 0.75), (4, 0.5), (5, 1.3)):
        assert torch.autograd.gradcheck(LocalResponseNorm(size, 0.01, beta, 1.0), (x,))
