"""A shard's rows of every table: their values, their clocks (how many updates each row
has had: a row's staleness is how far its clock moved since a worker pulled it) and their
lazy optimizer (optimizers.py).

The server (protocol/server.py) calls it as its rule decides: rows of a push held for a
synchronous round (weighted by examples, as the dense gradient) and stepped when the round
makes a version; applied at once in ps-async, each row judged by its own staleness under
the stale-gradient policy (``scale-lr`` divides a row's step by its staleness, ``drop``
leaves out rows staler than ``--max-staleness``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.tables import TableSpec, rows_of
from paratrain.strategies.ps.policies import StalePolicy
from paratrain.strategies.ps.tables import sections
from paratrain.strategies.ps.tables.layout import TableLayout
from paratrain.strategies.ps.tables.optimizers import RowOptimizer


class TableShard:
    def __init__(
        self,
        layout: TableLayout,
        shard: int,
        modules: list[nn.Module],
        groups: list[dict[str, Any]],
        kind: str,
        decoupled: bool,
        pull_dtype: torch.dtype = torch.float32,
    ):
        self.layout = layout
        self.shard = shard
        self.pull_dtype = pull_dtype
        self.specs: list[TableSpec] = layout.specs
        self.rows_on = [layout.rows_on(t, shard) for t in range(len(layout))]
        self.dims = [spec.dim for spec in self.specs]
        momentum = float(groups[0].get("momentum", 0.0)) if groups else 0.0
        check_memory(shard, layout.shard_bytes(shard), kind, momentum)
        self.rows = [rows_of(m, layout.global_ids(t, shard)) for t, m in enumerate(modules)]
        self.clocks = [torch.zeros(n, dtype=torch.int64) for n in self.rows_on]
        self.optimizers = [RowOptimizer(kind, g, r, decoupled) for g, r in zip(groups, self.rows)]
        self._held: list[tuple[sections.RowGrads, int]] = []
        self.row_staleness: Counter[int] = Counter()
        self.rows_served = 0
        self.rows_applied = 0
        self.rows_dropped = 0

    # ----- the wire -----------------------------------------------------------------------
    def request_bound(self) -> int:
        return sections.request_bound(self.rows_on)

    def push_bound(self) -> int:
        return sections.push_bound(self.rows_on, self.dims)

    def answer(self, section: torch.Tensor) -> torch.Tensor:
        """The reply to a row request: the rows' clocks, then the rows (Malformed: refused)."""
        ids = sections.read_request(section, self.rows_on)
        self.rows_served += sum(len(i) for i in ids)
        clocks = torch.cat([c[i] for c, i in zip(self.clocks, ids)])
        rows = torch.cat([r[i].reshape(-1) for r, i in zip(self.rows, ids)]).to(self.pull_dtype)
        return sections.pack_reply(clocks, rows)

    def read_push(self, section: torch.Tensor) -> sections.RowGrads:
        return sections.read_push(section, self.rows_on, self.dims, self.clocks)

    # ----- the rule's verdicts ------------------------------------------------------------
    def hold(self, grads: sections.RowGrads, samples: int) -> None:
        """Keep a push's rows for this round's average, weighted by its examples."""
        self._held.append((grads, samples))

    def drop_held(self) -> None:
        """The round made its version without an update (a gradient held a NaN or Inf): no
        table steps, as the dense optimizer does not (lazy-adam's bias correction counts
        the steps taken)."""
        self._held.clear()

    def step_held(self, total: int, lr_scale: float) -> None:
        """Step the average of the round's rows (each push's weighted by its examples)."""
        merged = []
        for t in range(len(self.specs)):
            ids = torch.cat([g.ids[t] for g, _ in self._held]) if self._held else torch.zeros(0, dtype=torch.int64)
            grads = torch.cat([g.grads[t] * (n / total) for g, n in self._held]) if self._held else None
            merged.append((ids, grads, None))
            self.row_staleness[0] += len(ids)
        self._held.clear()
        self.step_all(merged, lr_scale)

    def step_now(self, grads: sections.RowGrads, lr_scale: float, policy: StalePolicy | None) -> None:
        """ps-async: apply one push's rows at once, each row's learning rate scaled (or the
        row left out) by the policy for its own staleness, as the dense step's is for the
        push's: Adam's and Adagrad's steps do not shrink with the gradient."""
        merged = []
        for t in range(len(self.specs)):
            ids, g = grads.ids[t], grads.grads[t]
            staleness = self.clocks[t][ids] - grads.clocks[t]
            self.row_staleness.update(staleness.tolist())
            if policy is None or not len(ids):
                merged.append((ids, g, None))
                continue
            factors = torch.tensor([_factor(policy, s) for s in staleness.tolist()], dtype=torch.float32)
            keep = factors > 0
            self.rows_dropped += int((~keep).sum())
            merged.append((ids[keep], g[keep], factors[keep]))
        self.step_all(merged, lr_scale)

    def step_all(
        self, merged: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]], lr_scale: float
    ) -> None:
        """One step of every table (its step count moves even where no row was touched);
        each table's rows with their gradients and, where they differ, each row's factor of
        the learning rate (one row's are alike: its staleness is one)."""
        for t, optimizer in enumerate(self.optimizers):
            ids, grads, factors = merged[t]
            if len(ids):
                unique, inverse = torch.unique(ids, return_inverse=True)
                summed = torch.zeros(len(unique), self.dims[t]).index_add_(0, inverse, grads)
                scale = (
                    lr_scale if factors is None else lr_scale * torch.empty(len(unique)).scatter_(0, inverse, factors)
                )
                optimizer.step(unique, summed, scale)
                self.clocks[t][unique] += 1
                self.rows_applied += len(unique)
            else:
                optimizer.step(ids, torch.zeros(0, self.dims[t]), lr_scale)

    # ----- checkpoints and statistics ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.clone() for r in self.rows],
            "clocks": [c.clone() for c in self.clocks],
            "optimizers": [o.state_dict() for o in self.optimizers],
            "global_ids": [self.layout.global_ids(t, self.shard) for t in range(len(self.specs))],
            "names": [spec.name for spec in self.specs],
        }

    def holds_as_saved(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` (a shard's tables, saved) holds the rows this shard holds, in its
        order: not where the saving run sharded the rows another way (``--table-sharding``)."""
        self._check_names(state)
        ids = state["global_ids"]
        return len(ids) == len(self.specs) and all(
            torch.equal(saved, self.layout.global_ids(t, self.shard)) for t, saved in enumerate(ids)
        )

    def _check_names(self, state: dict[str, Any]) -> None:
        """ConfigError where the saving run made other modules tables (``--tables``)."""
        names = [spec.name for spec in self.specs]
        if state.get("names", names) != names:
            raise ConfigError(
                f"the checkpoint's tables are {', '.join(state['names'])}; this run's are {', '.join(names)} (--tables)"
            )

    def resharded(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """This shard's state from the table states of a checkpoint written by another number
        of shards or another sharding (each part names the global ids of its rows): rows,
        clocks and per-row optimizer state go to the shard that holds each row now."""
        state = self.state_dict()
        for t, spec in enumerate(self.specs):
            filled = torch.zeros(self.rows_on[t], dtype=torch.bool)
            for part in parts:
                self._check_names(part)
                if len(part["rows"]) != len(self.specs):
                    raise ConfigError(f"the checkpoint holds {len(part['rows'])} tables, this run {len(self.specs)}")
                ids = part["global_ids"][t]
                if len(ids) and int(ids.max()) >= spec.rows:
                    raise ConfigError(f"the checkpoint's table {spec.name} has rows past this model's {spec.rows}")
                shard, local = self.layout.locate(t, ids)
                mine = shard == self.shard
                state["rows"][t][local[mine]] = part["rows"][t][mine]
                state["clocks"][t][local[mine]] = part["clocks"][t][mine]
                saved = part["optimizers"][t]
                for key, value in state["optimizers"][t].items():
                    if torch.is_tensor(value):
                        value[local[mine]] = saved[key][mine]
                state["optimizers"][t]["steps"] = int(saved["steps"])
                filled[local[mine]] = True
            if not bool(filled.all()):
                raise ConfigError(f"the checkpoint's parts do not hold every row of table {spec.name}")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for t, rows in enumerate(state["rows"]):
            if rows.shape != self.rows[t].shape:
                raise ConfigError(f"checkpoint table {self.specs[t].name} holds {tuple(rows.shape)} rows on this shard")
            self.rows[t].copy_(rows)
            self.clocks[t].copy_(state["clocks"][t])
            self.optimizers[t].load_state_dict(state["optimizers"][t])

    def statistics(self) -> dict[str, Any]:
        return {
            "table_bytes": sum(r.numel() * 4 for r in self.rows),
            "rows_served": self.rows_served,
            "rows_applied": self.rows_applied,
            "rows_dropped": self.rows_dropped,
            "row_staleness": {str(k): v for k, v in sorted(self.row_staleness.items())},
        }


def _factor(policy: StalePolicy, staleness: int) -> float:
    factor = policy.factor(staleness)
    return 0.0 if factor is None else factor


def state_factor(kind: str, momentum: float) -> float:
    """Optimizer state per byte of rows: lazy-adam's two moments, sgd's momentum buffer."""
    return {"lazy-adam": 2.0, "sgd": 1.0 if momentum else 0.0}.get(kind, 0.0)


def check_memory(shard: int, row_bytes: int, kind: str, momentum: float, available: int | None = None) -> None:
    """ConfigError, before any row is made, when this shard's rows and their optimizer
    state cannot fit in the memory its host has available (``MemAvailable``)."""
    available = available if available is not None else _available_bytes()
    needed = row_bytes * (1 + state_factor(kind, momentum))
    if available is not None and needed > available:
        state = f"{kind}{' momentum' if kind == 'sgd' and momentum else ''} state"
        raise ConfigError(
            f"--tables: ps shard {shard} would hold {needed / 2**30:.1f} GiB of rows and {state}, its host has "
            f"{available / 2**30:.1f} GiB available: give more --ps-shards (each holds 1/P of the rows) or more memory"
        )


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
