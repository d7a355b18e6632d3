"""What travels for tables: a *section*, one byte message that follows its header on
``TAG_SECTION`` when the header says how long it is (``Header.extra``).

- A row request (``ROWS``): int64 ``[n_0 .. n_{T-1}, ids of table 0, ids of table 1, ...]``:
  the rows of each table the worker's batch touches, as rows of this shard, each once.
- Its reply (``TAG_ROWS``): int64 clocks of those rows (how many updates each has had),
  then the rows, in the pull dtype.
- A push's section: int64 ``[n_0 .. n_{T-1}, ids ..., clocks ...]`` (the clocks the rows
  had when pulled), then the float32 gradient rows.

``read_request`` and ``read_push`` refuse (``Malformed``) counts, ids or clocks out of
their range and a length that does not match the counts, before anything is applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.strategies.ps.protocol.wire import Malformed


@dataclass
class RowGrads:
    """One push's rows for one shard: per table, local ids, their clocks when pulled, and
    their gradient rows."""

    ids: list[torch.Tensor]
    clocks: list[torch.Tensor]
    grads: list[torch.Tensor]


def _bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def pack_request(ids: list[torch.Tensor]) -> torch.Tensor:
    counts = torch.tensor([len(i) for i in ids], dtype=torch.int64)
    return _bytes(counts, *ids)


def pack_push(ids: list[torch.Tensor], clocks: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    counts = torch.tensor([len(i) for i in ids], dtype=torch.int64)
    return _bytes(counts, *ids, *clocks, *[g.to(torch.float32) for g in grads])


def pack_reply(clocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return _bytes(clocks, rows)


def reply_bytes(count: int, row_elements: int, dtype: torch.dtype) -> int:
    """Bytes of a reply of ``count`` rows of ``row_elements`` elements in all."""
    return count * 8 + row_elements * dtype.itemsize


def read_reply(reply: torch.Tensor, count: int, dims: list[int], counts: list[int], dtype: torch.dtype):
    """(clocks, rows per table) of a reply to a request of ``counts`` rows per table."""
    clocks = reply[: count * 8].view(torch.int64)
    rows, at = [], count * 8
    for n, dim in zip(counts, dims):
        size = n * dim * dtype.itemsize
        rows.append(reply[at : at + size].view(dtype).view(n, dim).to(torch.float32))
        at += size
    return clocks, rows


def request_bound(rows_on: list[int]) -> int:
    """The longest request a shard holding ``rows_on`` rows per table takes."""
    return 8 * (len(rows_on) + sum(rows_on))


def push_bound(rows_on: list[int], dims: list[int]) -> int:
    return 8 * len(rows_on) + sum(n * (16 + 4 * d) for n, d in zip(rows_on, dims))


def _counts(section: torch.Tensor, rows_on: list[int]) -> list[int]:
    tables = len(rows_on)
    if section.numel() < 8 * tables or section.numel() % 4:
        raise Malformed("a table section cut short")
    counts = section[: 8 * tables].view(torch.int64).tolist()
    if any(not 0 <= n <= limit for n, limit in zip(counts, rows_on)):
        raise Malformed("a table section asks for more rows than the shard holds")
    return counts


def _ids(flat: torch.Tensor, counts: list[int], rows_on: list[int]) -> list[torch.Tensor]:
    ids = list(flat.split(counts))
    for table_ids, limit in zip(ids, rows_on):
        if len(table_ids) and (int(table_ids.min()) < 0 or int(table_ids.max()) >= limit):
            raise Malformed("a row id out of the shard's range")
        if len(torch.unique(table_ids)) != len(table_ids):
            raise Malformed("a row asked for twice in one section")
    return ids


def read_request(section: torch.Tensor, rows_on: list[int]) -> list[torch.Tensor]:
    counts = _counts(section, rows_on)
    if section.numel() != 8 * (len(rows_on) + sum(counts)):
        raise Malformed("a table section whose length does not match its counts")
    return _ids(section[8 * len(rows_on) :].view(torch.int64), counts, rows_on)


def read_push(section: torch.Tensor, rows_on: list[int], dims: list[int], clocks_now: list[torch.Tensor]) -> RowGrads:
    counts = _counts(section, rows_on)
    total = sum(counts)
    head = 8 * (len(rows_on) + 2 * total)
    if section.numel() != head + 4 * sum(n * d for n, d in zip(counts, dims)):
        raise Malformed("a table section whose length does not match its counts")
    longs = section[8 * len(rows_on) : head].view(torch.int64)
    ids = _ids(longs[:total], counts, rows_on)
    clocks = list(longs[total:].split(counts))
    for table_clocks, table_ids, now in zip(clocks, ids, clocks_now):
        if len(table_ids) and (bool((table_clocks < 0).any()) or bool((table_clocks > now[table_ids]).any())):
            raise Malformed("a row clock the shard has not reached")
    values = section[head:].view(torch.float32)
    grads = [g.view(n, d) for g, n, d in zip(values.split([n * d for n, d in zip(counts, dims)]), counts, dims)]
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        raise Malformed("a gradient row that is not finite")
    return RowGrads(ids, clocks, grads)
