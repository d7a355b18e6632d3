"""Embedding tables of a model, as a parameter server holds them row by row.

A table is an ``nn.Embedding`` or ``nn.EmbeddingBag`` whose weight no other module uses
(a weight tied to an output layer is read whole every step: it stays dense). ``--tables
all`` takes every such table, ``--tables NAME[,NAME]`` the modules named.

A table too large for one process is built on the meta device with a rule for its rows:
``init_rows(ids) -> (len(ids), dim)`` as an attribute of the module (``RowInit`` gives rows
that depend on the row's id alone, so a shard makes its own rows and a single process the
same whole table). ``materialize`` fills such tables in where a strategy needs them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import ConfigError

TABLE_TYPES = (nn.Embedding, nn.EmbeddingBag)
CHUNK_ROWS = 4096
"""Rows drawn from one seed by RowInit: a row's values depend on its id alone."""


@dataclass(frozen=True)
class TableSpec:
    """What the shards and workers agree on of one table."""

    name: str
    rows: int
    dim: int
    bag: bool = False
    mode: str = "mean"
    padding_idx: int | None = None

    @property
    def row_bytes(self) -> int:
        return self.dim * 4


class RowInit:
    """Rows drawn uniformly from ``[-scale, scale]``, chunk by chunk of CHUNK_ROWS rows from
    a seed of their own: any set of rows is the same whoever draws it."""

    def __init__(self, seed: int, dim: int, scale: float):
        self.seed = seed
        self.dim = dim
        self.scale = scale

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(ids), self.dim)
        ordered, order = torch.sort(ids)
        chunks, counts = torch.unique_consecutive(
            torch.div(ordered, CHUNK_ROWS, rounding_mode="floor"), return_counts=True
        )
        start = 0
        for chunk, count in zip(chunks.tolist(), counts.tolist()):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + chunk)
            block = torch.empty(CHUNK_ROWS, self.dim).uniform_(-self.scale, self.scale, generator=generator)
            at = slice(start, start + count)
            out[order[at]] = block[ordered[at] - chunk * CHUNK_ROWS]
            start += count
        return out


def spec_of(name: str, module: nn.Module) -> TableSpec:
    bag = isinstance(module, nn.EmbeddingBag)
    return TableSpec(
        name=name,
        rows=module.num_embeddings,
        dim=module.embedding_dim,
        bag=bag,
        mode=module.mode if bag else "mean",
        padding_idx=module.padding_idx,
    )


def find_tables(model: nn.Module, selection: str) -> list[tuple[str, nn.Module]]:
    """The tables ``selection`` names (``all``, or module names separated by commas), in
    model order; ConfigError naming one that cannot be a table, and why."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    modules = dict(model.named_modules())
    if selection == "all":
        chosen = [name for name, m in modules.items() if isinstance(m, TABLE_TYPES) and uses.get(id(m.weight)) == 1]
        if not chosen:
            raise ConfigError(
                "--tables all: the model has no nn.Embedding or nn.EmbeddingBag of its own (tied weights stay dense)"
            )
    else:
        chosen = [name.strip() for name in selection.split(",") if name.strip()]
    tables = []
    for name in chosen:
        module = modules.get(name)
        if not isinstance(module, TABLE_TYPES):
            found = [n for n, m in modules.items() if isinstance(m, TABLE_TYPES)]
            raise ConfigError(
                f"--tables {name}: no nn.Embedding or nn.EmbeddingBag of that name; the model has "
                f"{', '.join(found) or 'none'}"
            )
        check_table(name, module, uses.get(id(module.weight), 0))
        tables.append((name, module))
    return tables


def check_table(name: str, module: nn.Module, uses: int) -> None:
    if uses != 1:
        raise ConfigError(
            f"--tables {name}: its weight is tied to another module, which reads it whole: it stays dense"
        )
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise ConfigError(
            f"--tables {name}: max_norm and scale_grad_by_freq rewrite rows by the whole batch; a table on the "
            "parameter server takes neither"
        )
    if not module.weight.requires_grad:
        raise ConfigError(f"--tables {name}: a frozen table (requires_grad=False) needs no parameter server")
    if module.weight.is_meta and not callable(getattr(module, "init_rows", None)):
        raise ConfigError(
            f"--tables {name}: built on the meta device without init_rows(ids) to make its rows "
            "(paratrain.parallel.tables.RowInit)"
        )


def rows_of(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a table: from its weight, or made by its ``init_rows`` (meta)."""
    if module.weight.is_meta:
        return module.init_rows(ids).to(torch.float32)
    return module.weight.detach()[ids].to("cpu", torch.float32)


def materialize(model: nn.Module) -> nn.Module:
    """Give every table built on the meta device its whole weight (made by its init_rows)."""
    for _, module in model.named_modules():
        if isinstance(module, TABLE_TYPES) and module.weight.is_meta:
            if not callable(getattr(module, "init_rows", None)):
                raise ConfigError(f"a table on the meta device has no init_rows(ids) to make its rows: {module}")
            ids = torch.arange(module.num_embeddings)
            module.weight = nn.Parameter(torch.cat([module.init_rows(part) for part in ids.split(1 << 20)]))
    return model


def lookup(tables: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each table on its input, as ``[table(x) for ...]``; tables a parameter server holds
    fetch the rows of all of them in one round trip to the shards, not one per table (as
    TorchRec's collections of tables do)."""
    fetchers: dict[int, tuple[object, dict[int, torch.Tensor]]] = {}
    for table, ids in zip(tables, inputs):
        fetch = getattr(table, "fetch", None)
        if fetch is not None and hasattr(table, "wanted"):
            fetchers.setdefault(id(fetch), (fetch, {}))[1][table.index] = table.wanted(ids)
    for fetch, wanted in fetchers.values():
        fetch.prefetch(wanted)
    return [table(ids) for table, ids in zip(tables, inputs)]
