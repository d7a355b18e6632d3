"""A worker's side of the parameter-server protocol: one link to each shard (links.py),
the messages it sends them (wire.py) and the replies it waits for.

The client owns the buffers on the wire: one message a shard (header, then that shard's
compressed slice of the gradient), and the receives of every shard's next reply posted
ahead (Gloo moves a message only once its receive is posted), the parameters landing
straight in ``pulled``. What a reply means to training (staleness, copying to a device)
is the worker's (worker.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from paratrain.errors import WorkerLost
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.protocol.wire import (
    HEADER_BYTES,
    PUSH,
    ROWS,
    TAG_MESSAGE,
    TAG_REPLY,
    TAG_REPLY_HEADER,
    TAG_ROWS,
    TAG_SECTION,
    Header,
    checks_lateness,
    empty_reply_header,
    message_buffer,
    read_reply_header,
)
from paratrain.strategies.ps.tables import sections


class ShardClient:
    """Worker ``worker``'s links to every shard of ``layout``; ``pulled`` (host memory, the
    pull dtype) receives the parameters; ``packers`` (one a shard) compress the gradient;
    ``tags``: the run's offset of the message tags; ``store``: where, under backup workers,
    each shard keeps its version for the lateness check; every wait ends within
    ``timeout`` seconds (the links' own) and names the shard that did not answer."""

    def __init__(
        self,
        worker: int,
        links: list[Any],
        layout: ShardLayout,
        packers: list[Any],
        pulled: torch.Tensor,
        *,
        tags: int,
        store: Any,
        backup_workers: int,
        timeout: float,
    ):
        self.worker = worker
        self.links = links
        self.layout = layout
        self.packers = packers
        self.num_shards = len(links)
        self.pulled = pulled
        self.tags = tags
        self.store = store
        self.backup_workers, self.timeout = backup_workers, timeout
        self.messages = [message_buffer(p.nbytes) for p in packers]
        self.versions = [0] * self.num_shards
        """Each shard's version, as of its last reply."""
        self.assigned = -1
        """The batch shard 0 handed out with its last reply (wire.NO_MORE_BATCHES, NOT_ASSIGNED)."""
        self.bytes_sent = 0
        self.wait_seconds = 0.0
        self._replies: list[torch.Tensor] = []
        self._reply_works: list[Any] = []
        self._sends: list[Any] = []

    def post_reply(self) -> None:
        """Post the receives of every shard's next reply: its header, then its parameters
        straight into ``pulled``."""
        self._replies = [empty_reply_header() for _ in range(self.num_shards)]
        self._reply_works = []
        for shard, link in enumerate(self.links):
            self._reply_works.append(link.irecv(self._replies[shard], TAG_REPLY_HEADER + self.tags))
            self._reply_works.append(link.irecv(self.pulled[self.layout.shard_range(shard)], TAG_REPLY + self.tags))

    def await_reply(self) -> bool:
        """Wait for the posted reply of every shard; False when none was posted."""
        if not self._reply_works:
            return False
        started = time.perf_counter()
        self.wait(self._reply_works, "pull")
        self.wait_seconds += time.perf_counter() - started
        self._reply_works = []
        replies = [read_reply_header(r) for r in self._replies]
        self.versions = [version for version, _ in replies]
        self.assigned = replies[0][1]
        return True

    def send(
        self,
        header: Header,
        gradient: torch.Tensor | None = None,
        sections: list[torch.Tensor] | None = None,
        wanted_seen: bool = False,
    ) -> None:
        """One message to every shard: ``header`` (its version: that shard's; with
        ``wanted_seen``, the version it wants too: shards' versions part under ps-async,
        where one drops or skips a push another applies), then for a finite push in time
        that shard's slice of the flat ``gradient``, and its table ``sections`` (one a
        shard: its rows' gradients) as a message of their own."""
        # The previous message's buffers are reused now; its sends finished long ago in
        # practice, so waiting for them here keeps the wait off the step's critical path.
        self.drain()
        works = []
        for shard, link in enumerate(self.links):
            message = self.messages[shard]
            header.version = self.versions[shard]
            if wanted_seen:
                header.wanted = self.versions[shard]
            header.late = header.kind == PUSH and self._late(shard)
            # A late push (its round has closed) or one holding a NaN (which must not reach
            # the codec's state) is its header alone.
            payload = self.packers[shard].nbytes if header.has_payload else 0
            if payload:
                assert gradient is not None
                self.packers[shard].compress_into(
                    gradient[self.layout.shard_range(shard)], message[HEADER_BYTES : HEADER_BYTES + payload]
                )
            section = sections[shard] if sections is not None and header.has_payload else None
            header.extra = section.numel() if section is not None else 0
            message = header.write(message, payload)
            works.append(link.isend(message, TAG_MESSAGE + self.tags))
            self.bytes_sent += message.numel() * message.element_size()
            if section is not None:
                works.append(link.isend(section, TAG_SECTION + self.tags))
                self.bytes_sent += section.numel()
        self._sends = works

    def fetch_rows(self, requests: list[list[torch.Tensor]], layout: Any, dtype: torch.dtype) -> list[Any]:
        """The rows ``requests`` asks of each shard (per table: the shard's row ids), with
        their clocks: per shard, (clocks, rows per table); one round trip to the shards asked."""
        self.drain()
        dims = [spec.dim for spec in layout.specs]
        works = []
        replies = []
        sends = []
        for shard, ids in enumerate(requests):
            counts = [len(i) for i in ids]
            total = sum(counts)
            if not total:
                replies.append(None)
                continue
            reply = torch.empty(
                sections.reply_bytes(total, sum(n * d for n, d in zip(counts, dims)), dtype), dtype=torch.uint8
            )
            works.append(self.links[shard].irecv(reply, TAG_ROWS + self.tags))
            section = sections.pack_request(ids)
            message = Header(ROWS, version=self.versions[shard], extra=section.numel()).write(self.messages[shard])
            sends += [
                self.links[shard].isend(message, TAG_MESSAGE + self.tags),
                self.links[shard].isend(section, TAG_SECTION + self.tags),
            ]
            self.bytes_sent += message.numel() + section.numel()
            replies.append((reply, total, counts))
        started = time.perf_counter()
        self.wait(sends, "row request")
        self.wait(works, "rows")
        self.wait_seconds += time.perf_counter() - started
        empty = (torch.zeros(0, dtype=torch.int64), [torch.zeros(0, d) for d in dims])
        return [empty if r is None else sections.read_reply(r[0], r[1], dims, r[2], dtype) for r in replies]

    def message_bytes(self) -> int:
        """The bytes of one whole message to every shard."""
        return sum(m.numel() * m.element_size() for m in self.messages)

    def drain(self) -> None:
        """Wait for the sends of the last message (each c10d/Gloo work may be waited on
        once: a second wait blocks for ever)."""
        sends, self._sends = self._sends, []
        self.wait(sends, "send")

    def _late(self, shard: int) -> bool:
        """Under backup workers, whether ``shard`` has published a version since this
        worker's parameters: its round closed without it, and its gradient would be dropped
        on arrival. Only large pushes ask (checks_lateness): the lookup is a round trip to
        the store."""
        if not checks_lateness(self.backup_workers, self.packers[shard].nbytes):
            return False
        return int(self.store.get(f"version/{shard}")) > self.versions[shard]

    def wait(self, works: list[Any], what: str) -> None:
        """Wait for one operation a shard, or two (a reply's header and parameters)."""
        per_shard = max(len(works) // max(self.num_shards, 1), 1)
        for index, work in enumerate(works):
            try:
                work.wait()
            except RuntimeError as error:
                # Every wait ends within --timeout (the process group's); say whom it waited for.
                raise WorkerLost(
                    f"worker {self.worker}: {what} failed, ps shard {index // per_shard} stopped answering "
                    f"(within --timeout {self.timeout:g} s): {str(error).splitlines()[0]}"
                ) from None
