"""LSTM classifier: (embedding,) LSTM, last step, linear.

On token data (``input_kind == "tokens"``) it embeds the ids, as in text
classification. On images it reads one row per time step (the classic row-by-row
sequence model), so it also trains on digits or Fashion-MNIST.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paratrain.data.spec import DataSpec
from paratrain.parallel.wavefront import WavefrontParts


class LSTMClassifier(nn.Module):
    def __init__(self, spec: DataSpec, embedding_dim: int = 64, hidden: int = 128, layers: int = 1):
        super().__init__()
        if spec.input_kind == "tokens":
            self.embedding: nn.Module | None = nn.Embedding(max(spec.vocab_size, 2), embedding_dim, padding_idx=0)
            features = embedding_dim
        else:
            self.embedding = None
            # (C, H, W): H time steps of C*W features.
            features = math.prod(spec.input_shape) // spec.input_shape[-2] if len(spec.input_shape) > 1 else 1
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, spec.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The LSTM's inputs ``(batch, time, features)`` from a batch."""
        if self.embedding is not None:
            return self.embedding(x)
        if x.dim() == 4:  # (N, C, H, W) -> (N, H, C*W)
            return x.permute(0, 2, 1, 3).flatten(2)
        return x.unsqueeze(-1) if x.dim() == 2 else x

    def classify(self, output: torch.Tensor) -> torch.Tensor:
        """The logits from the last layer's outputs: its last step through the head."""
        return self.head(output[:, -1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.features(x))
        return self.classify(output)

    def wavefront_parts(self) -> WavefrontParts:
        """How ``--schedule wavefront`` splits it: one LSTM layer a stage, the embedding on
        the first, the head on the last (parallel/wavefront.py)."""
        return WavefrontParts(
            front=self.features,
            lstm=self.lstm,
            back=self.classify,
            length=lambda x: x.shape[2] if x.dim() == 4 else x.shape[1],
            front_modules=[self.embedding] if self.embedding is not None else [],
            back_modules=[self.head],
        )


def build_lstm(spec: DataSpec, options: Any = None) -> nn.Module:
    """``options``: the run's ``--lstm-*`` sizes (models/lstm_config.py), if any."""
    return LSTMClassifier(spec, layers=options.lstm_layers if options is not None else 1)
