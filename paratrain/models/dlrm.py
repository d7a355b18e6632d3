"""DLRM-style recommendation model (Naumov et al. 2019): dense features through a bottom
MLP, each categorical feature through an embedding table, their pairwise dot products,
then a top MLP to a click or not.

Its tables are ``nn.EmbeddingBag`` built on the meta device with a ``RowInit``: a run that
holds them on the parameter server (``--tables all``) never makes them whole in any
process, so a table may be larger than a worker's memory; everywhere else they are made
whole at once (``lazy_tables=False``, the default), each row the same as a shard's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.data.spec import DataSpec
from paratrain.errors import ConfigError
from paratrain.parallel.tables import RowInit, lookup, materialize


def _mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(dense, ids)``: dense features ``(batch, F)``, one row id per table
    ``(batch, T)``; returns two logits (no click, click)."""

    def __init__(self, spec: DataSpec, dim: int = 16, bottom: int = 64, top: int = 64, lazy_tables: bool = False):
        super().__init__()
        if spec.input_kind != "clicks" or not spec.tables:
            raise ConfigError(
                f"model dlrm needs click data (dense features and table ids: --dataset clicks), not {spec.input_kind}"
            )
        self.bottom = _mlp([spec.input_shape[0], bottom, dim])
        self.tables = nn.ModuleList()
        for rows in spec.tables:
            table = nn.EmbeddingBag(rows, dim, mode="sum", device="meta")
            table.init_rows = RowInit(int(torch.randint(1 << 30, ())), dim, rows**-0.5)
            self.tables.append(table)
        features = len(spec.tables) + 1
        self.top = _mlp([dim + features * (features - 1) // 2, top, spec.num_classes], last_relu=False)
        if not lazy_tables:
            materialize(self)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        embedded = lookup(self.tables, [ids[:, t : t + 1] for t in range(len(self.tables))])
        vectors = torch.stack([x, *embedded], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1))


def build_dlrm(spec: DataSpec, options: Any = None, lazy_tables: bool = False) -> nn.Module:
    """``options``: the run's ``--dlrm-*`` sizes (models/dlrm_config.py), if any."""
    sizes = {} if options is None else {"dim": options.dlrm_dim, "bottom": options.dlrm_bottom, "top": options.dlrm_top}
    return DLRM(spec, lazy_tables=lazy_tables, **sizes)
