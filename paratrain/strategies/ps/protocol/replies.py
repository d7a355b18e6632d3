"""What a parameter-server shard sends back: replies to pulls and pushes (its version,
the worker's next batch, its parameters in the pull dtype) and to row requests (tables/),
kept until sent: their bytes are read from the shard's parameters, which must not change
under them (``flush`` before each update)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from paratrain.strategies.ps.protocol.wire import (
    NOT_ASSIGNED,
    TAG_REPLY,
    TAG_REPLY_HEADER,
    TAG_ROWS,
    Malformed,
    reply_header,
)


class Replies:
    def __init__(self, server: Any):
        self.server = server  # the ShardServer (server.py) whose replies these are
        self.sending: list[Any] = []  # (worker, send, tensor) in flight
        self.cast: tuple[int, torch.Tensor] | None = None  # the parameters in the pull dtype, per version

    def params(self, worker: int, batch: int = NOT_ASSIGNED) -> None:
        """The reply to a pull or a push: the shard's version (and the worker's next batch), then its parameters."""
        server = self.server
        clocks = server.rule.clocks(server)
        live = [clocks[w] for w in server.active_workers()]
        if live and worker in clocks:
            server.counters.max_clock_gap = max(server.counters.max_clock_gap, clocks[worker] - min(live))
        link = server.links[worker]
        version = reply_header(server.version, batch)
        params = self._pull_payload()
        self.sending.append((worker, link.isend(version, TAG_REPLY_HEADER + server.tags), version))
        self.sending.append((worker, link.isend(params, TAG_REPLY + server.tags), None))
        server.counters.bytes_sent += version.numel() * 8 + params.numel() * params.element_size()

    def rows(self, worker: int, section: torch.Tensor) -> None:
        """Answer a row request at once, with the rows as they are now (tables/shard.py)."""
        server = self.server
        try:
            reply = server.tables.answer(section)
        except Malformed as refusal:
            server.receiving.refuse(worker, refusal.reason)
            return
        self.sending.append((worker, server.links[worker].isend(reply, TAG_ROWS + server.tags), reply))
        server.counters.bytes_sent += reply.numel()

    def _pull_payload(self) -> torch.Tensor:
        server = self.server
        if server.pull_dtype == server.params.dtype:
            return server.params
        if self.cast is None or self.cast[0] != server.version:
            self.cast = (server.version, server.params.to(server.pull_dtype))
        return self.cast[1]

    def flush(self) -> None:
        """Wait for the replies in flight (their bytes are read from ``server.params``), each at
        most the heartbeat timeout. A worker posts its receive before it asks, so a live one
        takes its reply at once; one that has not within that time is stopped or its host is
        gone, and is lost: over Gloo a send ends only when its receiver takes it, and it would
        hold the shard, every other worker with it, until Gloo's timeout (``--timeout``)."""
        server = self.server
        bound = server.watch.heartbeat_timeout
        for worker, work, _ in self.sending:
            try:
                work.wait(timedelta(seconds=bound))
            except RuntimeError as error:
                if worker in server.lost:
                    continue
                timed_out = "Timed out" in str(error)
                server._lose(
                    worker, f"it did not take its reply within {bound:g} s" if timed_out else "its connection closed"
                )
        self.sending.clear()
