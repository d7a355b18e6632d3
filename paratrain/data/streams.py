"""A stream's batches for one replica: in training the stream's places it is given, in
evaluation over several replicas as many batches as every other replica takes.

Training takes whole batches of a stream in turns (replica ``r`` of ``R``: ``r, r+R, ...``,
``len(stream) // R`` each). Evaluation must count every example once, and under fsdp every
shard of a replica group must take as many forwards as the others (each forward all-gathers
the parameters): so the stream is read in rounds of ``R`` batches, replica ``r`` taking the
``r``-th of each whole round, and each batch of the last, short round (``m < R`` batches) is
split into ``R`` near-equal pieces, replica ``r`` taking the ``r``-th of each. Every replica
then takes ``len // R + m`` batches, which it knows without ``len()``: every replica reads the
whole stream. A piece of a batch of fewer than ``R`` examples may be empty; evaluation runs
its forward (for the collectives) and counts nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from paratrain.data.batch import as_pair, map_tensors, num_examples, part_of


def batches_at(stream: Iterable[Any], places: Iterator[int], where: str) -> Iterator[tuple[Any, Any]]:
    """The ``(inputs, targets)`` of ``stream`` at ``places`` (increasing): a training replica's."""
    wanted = next(places, None)
    for place, item in enumerate(stream):
        if wanted is None:
            return
        if place == wanted:
            yield as_pair(item, where)
            wanted = next(places, None)


def evaluation_batches(stream: Iterable[Any], rank: int, replicas: int, where: str) -> Iterator[tuple[Any, Any]]:
    """Replica ``rank``'s ``(inputs, targets)`` of ``stream`` (of ``replicas``), as above."""
    round_: list[Any] = []
    for item in stream:
        round_.append(item)
        if len(round_) == replicas:
            yield as_pair(round_[rank], where)
            round_ = []
    for item in round_:
        inputs, targets = as_pair(item, where)
        rows = part_of(num_examples(targets), rank, replicas)
        yield map_tensors(inputs, lambda t: t[rows]), map_tensors(targets, lambda t: t[rows])


def evaluation_count(batches: int, replicas: int) -> int:
    """How many batches each replica takes of a stream of ``batches``."""
    return batches // replicas + batches % replicas
