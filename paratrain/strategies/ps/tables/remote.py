"""A worker's tables: each ``nn.Embedding`` / ``nn.EmbeddingBag`` the run serves from the
shards is replaced in the worker's model by a ``RemoteTable``, which holds no rows. Its
forward pass asks the shards for the rows its input touches (each once), computes the
embedding on them, and keeps them with their gradients for the push; the worker never
holds a whole table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.tables import TableSpec
from paratrain.strategies.ps.tables import sections
from paratrain.strategies.ps.tables.layout import TableLayout


class RemoteTable(nn.Module):
    """Table ``index`` (``spec``) of the run, its rows fetched through ``rows``."""

    def __init__(self, index: int, spec: TableSpec, rows: TableRows | None, include_last_offset: bool = False):
        super().__init__()
        self.index = index
        self.spec = spec
        self.fetch = rows
        self.include_last_offset = include_last_offset

    def extra_repr(self) -> str:
        return f"{self.spec.name}: {self.spec.rows} x {self.spec.dim} on the parameter server"

    def wanted(self, input: torch.Tensor) -> torch.Tensor:
        """The rows ``input`` touches, each once (sorted)."""
        return torch.unique(input.reshape(-1)).cpu()

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        spec = self.spec
        unique, inverse = torch.unique(input.reshape(-1), return_inverse=True)
        if len(unique) and (int(unique[0]) < 0 or int(unique[-1]) >= spec.rows):  # sorted: the ends tell
            bad = int(unique[0]) if int(unique[0]) < 0 else int(unique[-1])
            raise ConfigError(f"table {spec.name}: row id {bad} is out of its range 0..{spec.rows - 1}")
        weight = self.fetch.rows(self.index, unique.cpu()).to(input.device)
        inverse = inverse.view_as(input)
        padding = None
        if spec.padding_idx is not None:
            at = (unique == spec.padding_idx).nonzero()
            padding = int(at[0, 0]) if len(at) else None
        if not spec.bag:
            return F.embedding(inverse, weight, padding_idx=padding)
        return F.embedding_bag(
            inverse,
            weight,
            offsets,
            mode=spec.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )


class TableRows:
    """A worker's fetches of rows from the shards (over ``client``: protocol/client.py) and
    the rows it pulled this step, whose gradients its push carries."""

    def __init__(self, layout: TableLayout, client: Any, pull_dtype: torch.dtype):
        self.layout = layout
        self.client = client
        self.pull_dtype = pull_dtype
        self.pulled: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(table, global ids, their clocks, the rows as leaves whose .grad backward fills)."""
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        self.pulled = []
        self._ready = {}

    def prefetch(self, wanted: dict[int, torch.Tensor]) -> None:
        """Fetch the rows of several tables (``table: unique global ids``) in one round trip,
        for their forward passes to take (``parallel.tables.lookup``)."""
        self._ready.update(self._fetch(wanted))

    def read(self, table: int | str, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all of them when None) of a table (by index or module name), as the
        shards hold them now: to look at or export a trained table, a chunk at a time."""
        if isinstance(table, str):
            names = [spec.name for spec in self.layout.specs]
            if table not in names:
                raise KeyError(f"no table {table!r} on the shards; they hold {', '.join(names)}")
            table = names.index(table)
        if ids is None:
            ids = torch.arange(self.layout.specs[table].rows)
        unique, inverse = torch.unique(ids, return_inverse=True)
        return self._fetch({table: unique})[table][1][inverse]

    def rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (unique global ids) of ``table``, as a leaf tensor when gradients are on."""
        ready = self._ready.pop(table, None)
        if ready is None or not torch.equal(ready[0], ids):
            ready = self._fetch({table: ids})[table]
        _, rows, clocks = ready
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self.pulled.append((table, ids, clocks, rows))
        return rows

    def _fetch(self, wanted: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(ids, rows, clocks) of each table of ``wanted``, from every shard that holds some."""
        layout, none = self.layout, torch.zeros(0, dtype=torch.int64)
        located = {table: layout.locate(table, ids) for table, ids in wanted.items()}
        at = {
            table: [(shards == s).nonzero().squeeze(1) for s in range(layout.num_shards)]
            for table, (shards, _) in located.items()
        }
        requests = [
            [located[t][1][at[t][s]] if t in wanted else none for t in range(len(layout))]
            for s in range(layout.num_shards)
        ]
        replies = self.client.fetch_rows(requests, layout, self.pull_dtype)
        out = {}
        for table, ids in wanted.items():
            rows = torch.empty(len(ids), layout.specs[table].dim)
            clocks = torch.empty(len(ids), dtype=torch.int64)
            for shard, (shard_clocks, shard_rows) in enumerate(replies):
                where = at[table][shard]
                if len(where):
                    rows[where] = shard_rows[table]
                    first = sum(len(at[t][shard]) for t in wanted if t < table)  # clocks run table by table
                    clocks[where] = shard_clocks[first : first + len(where)]
            out[table] = (ids, rows, clocks)
        return out

    def gradients(self) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """This step's row gradients: per shard, per table (local ids, clocks, gradient rows),
        each row once (rows pulled by several forward passes summed; the oldest clock kept)."""
        out = [[_empty(spec.dim) for spec in self.layout.specs] for _ in range(self.layout.num_shards)]
        for table, spec in enumerate(self.layout.specs):
            taken = [
                (i, c, r.grad if r.grad is not None else torch.zeros_like(r))
                for t, i, c, r in self.pulled
                if t == table
            ]
            if not taken:
                continue
            ids = torch.cat([i for i, _, _ in taken])
            unique, inverse = torch.unique(ids, return_inverse=True)
            grads = torch.zeros(len(unique), spec.dim).index_add_(0, inverse, torch.cat([g for _, _, g in taken]).cpu())
            clocks = torch.full((len(unique),), torch.iinfo(torch.int64).max, dtype=torch.int64)
            clocks.scatter_reduce_(0, inverse, torch.cat([c for _, c, _ in taken]), "amin")
            shards, local = self.layout.locate(table, unique)
            for shard in range(self.layout.num_shards):
                at = shards == shard
                out[shard][table] = (local[at], clocks[at], grads[at])
        return out

    def finite(self) -> bool:
        return all(r.grad is None or bool(torch.isfinite(r.grad).all()) for _, _, _, r in self.pulled)

    def sections(self) -> list[torch.Tensor]:
        """This step's push section for every shard (sections.py)."""
        return [
            sections.pack_push([i for i, _, _ in tables], [c for _, c, _ in tables], [g for _, _, g in tables])
            for tables in self.gradients()
        ]


def _empty(dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim)


def swap_tables(
    model: nn.Module, tables: list[tuple[str, nn.Module]], rows: TableRows | None, specs: list[TableSpec]
) -> None:
    """Replace each table module of ``model`` by its RemoteTable (the table's weight goes)."""
    for index, ((name, module), spec) in enumerate(zip(tables, specs)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        last = bool(getattr(module, "include_last_offset", False))
        setattr(parent, child, RemoteTable(index, spec, rows, last))
