"""LSTM classifier: (embedding,) LSTM, last step, linear.

On token data (``input_kind == "tokens"``) it embeds the ids, as in text
classification. On images it reads one row per time step (the classic row-by-row
sequence model), so it also trains on digits or Fashion-MNIST.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.data.spec import DataSpec


class LSTMClassifier(nn.Module):
    def __init__(self, spec: DataSpec, embedding_dim: int = 64, hidden: int = 128):
        super().__init__()
        if spec.input_kind == "tokens":
            self.embedding: nn.Module | None = nn.Embedding(max(spec.vocab_size, 2), embedding_dim, padding_idx=0)
            features = embedding_dim
        else:
            self.embedding = None
            # (C, H, W): H time steps of C*W features.
            features = math.prod(spec.input_shape) // spec.input_shape[-2] if len(spec.input_shape) > 1 else 1
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        elif x.dim() == 4:  # (N, C, H, W) -> (N, H, C*W)
            x = x.permute(0, 2, 1, 3).flatten(2)
        elif x.dim() == 2:
            x = x.unsqueeze(-1)
        output, _ = self.lstm(x)
        return self.head(output[:, -1])


def build_lstm(spec: DataSpec) -> nn.Module:
    return LSTMClassifier(spec)
