"""Which shard holds which rows of which table.

``mod`` (the default) puts row ``r`` on shard ``r % P`` at ``r // P``: hot rows (small ids
under a Zipf law) spread over every shard. ``range`` gives each shard one contiguous run
of rows (``r`` on shard ``r * P // rows``), for ids whose popularity does not follow their
order.
"""

from __future__ import annotations

import torch

from paratrain.errors import ConfigError
from paratrain.parallel.tables import TableSpec

SHARDINGS = ("mod", "range")


class TableLayout:
    def __init__(self, specs: list[TableSpec], num_shards: int, sharding: str = "mod"):
        if sharding not in SHARDINGS:
            raise ConfigError(f"--table-sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
        self.specs = specs
        self.num_shards = num_shards
        self.sharding = sharding
        self.bounds = [[spec.rows * s // num_shards for s in range(num_shards + 1)] for spec in specs]

    def __len__(self) -> int:
        return len(self.specs)

    def rows_on(self, table: int, shard: int) -> int:
        rows, shards = self.specs[table].rows, self.num_shards
        if self.sharding == "mod":
            return max(rows - shard + shards - 1, 0) // shards
        return self.bounds[table][shard + 1] - self.bounds[table][shard]

    def locate(self, table: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard, row within the shard) of each global row id."""
        if self.sharding == "mod":
            return ids % self.num_shards, torch.div(ids, self.num_shards, rounding_mode="floor")
        starts = torch.tensor(self.bounds[table][1:-1], dtype=ids.dtype)
        shard = torch.bucketize(ids, starts, right=True)
        return shard, ids - torch.tensor(self.bounds[table], dtype=ids.dtype)[shard]

    def global_ids(self, table: int, shard: int, local: torch.Tensor | None = None) -> torch.Tensor:
        """The global ids of rows ``local`` of ``shard`` (all of its rows when None)."""
        if local is None:
            local = torch.arange(self.rows_on(table, shard))
        if self.sharding == "mod":
            return local * self.num_shards + shard
        return local + self.bounds[table][shard]

    def shard_bytes(self, shard: int) -> int:
        return sum(self.rows_on(t, shard) * spec.row_bytes for t, spec in enumerate(self.specs))
