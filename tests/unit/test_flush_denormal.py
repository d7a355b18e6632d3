"""The Trainer flushes denormal numbers on the CPU by default (``flush_denormal``), as
TensorFlow does: an LSTM's gradient fading through 200 steps became denormal and each
step took 1.55 s instead of 0.105 (one thread, the lstm of benchmarks/tensorflow_mirrored.py)."""

import pytest
import torch
from torch import nn

import paratrain
from paratrain.config import TrainConfig

DENORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def _trainer(**options):
    model = nn.Linear(4, 2)
    return paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.1),
        metrics=(),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
        **options,
    )


@pytest.fixture
def restore():
    yield
    torch.set_flush_denormal(True)  # as every Trainer of the suite leaves it


def test_denormals_are_flushed_unless_the_trainer_is_told_not_to(restore):
    _trainer(cpu=paratrain.CpuTuning(flush_denormal=False))
    assert (torch.tensor([DENORMAL]) * 1.0).item() != 0.0
    _trainer()
    assert (torch.tensor([DENORMAL]) * 1.0).item() == 0.0
    assert TrainConfig().flush_denormal is True and TrainConfig(flush_denormal=False).flush_denormal is False
