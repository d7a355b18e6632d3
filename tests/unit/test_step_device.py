"""A fit's steps and the default device that ``strategy.scope()`` sets (train/step_device.py).

The scope sets one only where the strategy's device is not the default already (a GPU);
here the default device is ``meta`` around the scope of a CPU strategy, which a CPU
machine can do: the scope then makes the CPU the default, as it makes CUDA on a GPU."""

import torch
from torch import nn

import paratrain


class _Net(nn.Module):
    """Counts the torch function modes over each forward; ``loose``: adds a tensor made
    without a device, which only a default device puts on the CPU."""

    def __init__(self, loose: bool):
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.loose = loose
        self.modes = []

    def forward(self, x):
        self.modes.append(torch._C._len_torch_function_stack())
        out = self.layer(x)
        return out + torch.zeros(out.shape[1]) if self.loose else out


def _fit(loose: bool, capsys):
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    with torch.device("meta"), strategy.scope():
        torch.manual_seed(0)
        model = _Net(loose)
        x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
        trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
        history = trainer.fit((x, y), epochs=2, batch_size=16, verbose=0, log_every=0)
    return model, history, capsys.readouterr().out


def test_steps_that_make_no_tensor_without_a_device_run_without_the_default_device(capsys):
    model, history, out = _fit(False, capsys)
    # meta's mode and the scope's CPU over the first step (the probe in the CPU's place), then
    # meta's alone: the scope's is dropped (on a GPU machine, no mode is left)
    assert model.modes == [2] + [1] * 7
    assert len(history.epochs) == 2 and "without a device" not in out


def test_a_step_that_makes_a_tensor_without_a_device_keeps_the_default_device_on_every_step(capsys):
    model, history, out = _fit(True, capsys)
    assert model.modes == [2] * 8
    assert all(torch.isfinite(torch.tensor(e["train_loss"])) for e in history.epochs)
    assert out.count("the training step makes a tensor without a device (torch.zeros)") == 1


def test_without_a_default_device_to_drop_the_steps_are_as_they_were(capsys):
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    with strategy.scope():
        model = _Net(True)
        trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
        trainer.fit((torch.randn(32, 6), torch.randint(0, 3, (32,))), epochs=1, batch_size=16, verbose=0)
    assert model.modes == [0, 0] and "without a device" not in capsys.readouterr().out
