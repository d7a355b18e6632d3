"""A user's own model, data, loss and metric, for ``paratrain train`` and the Python API.

House prices, made up: four numeric features and a neighbourhood (one of 8 categories)
per house; the price is a linear function of the features plus a value per
neighbourhood, plus noise. The data set is a plain map-style Dataset whose examples are
``({"numeric": ..., "neighbourhood": ...}, price)``: a dict of inputs, so the model is
called as ``model(numeric=..., neighbourhood=...)``.

    cd examples/user_project
    paratrain train --model tabular:model --dataset tabular:data --loss mse \\
        --metrics mae,tabular:within_10_percent --strategy allreduce --workers 2
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

NEIGHBOURHOODS = 8
FEATURES = 4


class Houses(Dataset):
    """``n`` houses drawn with ``seed``; the same prices rule for every seed."""

    def __init__(self, n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        rule = torch.Generator().manual_seed(1234)  # the market: fixed
        weights = torch.randn(FEATURES, generator=rule)
        values = torch.randn(NEIGHBOURHOODS, generator=rule)
        self.numeric = torch.randn(n, FEATURES, generator=generator)
        self.neighbourhood = torch.randint(0, NEIGHBOURHOODS, (n,), generator=generator)
        noise = 0.1 * torch.randn(n, generator=generator)
        self.price = 3.0 + self.numeric @ weights + values[self.neighbourhood] + noise

    def __len__(self) -> int:
        return len(self.price)

    def __getitem__(self, index: int):
        inputs = {"numeric": self.numeric[index], "neighbourhood": self.neighbourhood[index]}
        return inputs, self.price[index]


class PriceModel(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(NEIGHBOURHOODS, 4)
        self.body = nn.Sequential(nn.Linear(FEATURES + 4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, numeric: torch.Tensor, neighbourhood: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([numeric, self.embedding(neighbourhood)], dim=-1))


def data(config=None):
    """``--dataset tabular:data``: the train and test splits."""
    return Houses(2048, seed=0), Houses(512, seed=1)


def model(spec=None):
    """``--model tabular:model``: a fresh model (paratrain seeds torch before calling it)."""
    return PriceModel()


def within_10_percent(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A metric: the share of houses priced within 10% of the truth."""
    return ((outputs.reshape(targets.shape) - targets).abs() <= 0.1 * targets.abs()).float().mean()
