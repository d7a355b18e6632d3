"""A model that draws random numbers as it trains (dropout) on data read through a
DataLoader (a map-style Dataset, dict examples): a run resumed from a checkpoint, mid-epoch
or at an epoch's end, goes on exactly as the run never stopped."""

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import paratrain
from paratrain.train.callbacks import Callback
from paratrain.train.checkpoint import Checkpoint


class Examples(Dataset):
    """Dict examples, as a tokenizer or ``datasets`` gives them: read through a DataLoader."""

    def __init__(self, n=96):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i]}, self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))

    def forward(self, features):
        return self.body(features)


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, step, logs):
        if step == self.step:
            self.trainer.stop_training = True


def _fit(epochs, *callbacks):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = paratrain.Trainer(
        model, "cross_entropy", optimizer, strategy=paratrain.SingleDeviceStrategy(device="cpu")
    )
    trainer.fit(
        Examples(), epochs=epochs, batch_size=8, validation_data=Examples(16), verbose=0, callbacks=list(callbacks)
    )
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("stop", [17, 24], ids=["mid-epoch", "at an epoch's end"])
def test_a_run_resumed_with_dropout_goes_on_exactly(tmp_path, stop):
    whole = _fit(3)
    _fit(3, Checkpoint(tmp_path, every_steps=1), StopAt(stop))  # 12 steps an epoch
    resumed = _fit(3, Checkpoint(tmp_path, every_steps=100, resume=True))
    assert not torch.equal(whole, _fit(2)), "the runs must train past the stop"
    assert torch.equal(resumed, whole)
