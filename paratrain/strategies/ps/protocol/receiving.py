"""A shard's threads that read its links: one takes the run's own workers' messages from
any of them in arrival order (``recv(src=None)``), one a joiner over its own link. Every
message is validated first (validator.py); a refused one is counted and its sender judged, and
the shard acts only on the rest (``ShardServer._handle``), at once: no hand-off, so a round
trip costs one wake-up. Once Gloo cannot post a receive from any worker (a worker died with
a message announced), each of the run's workers gets a thread of its own too."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.strategies.ps.protocol.wire import SHUTDOWN, TAG_MESSAGE, TAG_SECTION, Header, Malformed, blank

MAX_BROKEN_RECEIVES = 100
"""Receives failing in a row before the shard gives up serving: one dying worker breaks one
message (its loss is then the monitor's to judge); a run of failures is the link itself gone."""


class Receiving:
    def __init__(self, server: Any):
        self.server = server  # the ShardServer (server.py) whose links these threads read

    def run(self) -> None:
        """The run's own workers' messages until the chief's word that the run is over."""
        server = self.server
        try:
            self._receive()
        except BaseException as error:  # never die silently: the shard would wait forever
            with server.lock:
                server.fatal = f"ps shard {server.shard}: receiving failed: {str(error).splitlines()[0]}"
                server.finished.set()

    def _receive(self) -> None:
        server = self.server
        current, broken = 0, 0
        work = self._post(current)
        while True:
            if work is None:
                return self._each_worker()
            try:
                work.wait()
                broken = 0
            except RuntimeError:
                # A worker died in the middle of a message. Its loss is the monitor's to
                # judge (heartbeats); keep serving the others, unless the link itself is gone.
                broken += 1
                if broken > MAX_BROKEN_RECEIVES:
                    raise
                work = self._post(current)
                continue
            worker, message = work._source_rank() - server.num_shards, server.messages[current]
            header = self.validated(worker, message)
            if header is None or header.kind != SHUTDOWN:
                # the next receive, posted now (one left posted would take a later run's message)
                current = 1 - current
                work = self._post(current)
            if header is not None and not server._handle(worker, message, header, self.section(worker, header)):
                return

    def _post(self, current: int) -> Any:
        """A receive from any worker into message buffer ``current``; None once Gloo refuses
        to post one. It does from the moment a worker announced a message and died before the
        shard took it: Gloo offers every later receive from any rank on this tag to that
        worker's dead link first, and fails it."""
        server = self.server
        try:
            return dist.irecv(blank(server.messages[current]), src=None, tag=TAG_MESSAGE + server.tags)
        except RuntimeError:
            return None

    def _each_worker(self) -> None:
        """The run's workers not lost, each over its own link on a thread of its own, until
        the chief's word that the run is over: what serves them once a receive from any of
        them cannot be posted (``_post``)."""
        server = self.server
        over = threading.Event()
        with server.lock:
            workers = [w for w in range(server.num_workers) if w not in server.lost]
        for worker in workers:
            args = (worker, server.links[worker], over)
            threading.Thread(target=self._read, args=args, name="ps-receiver", daemon=True).start()
        over.wait()

    def joined(self, worker: int, link: Any) -> None:
        """A worker that joined, over its own link, until it is done, dropped, or its link
        fails (its loss is then the monitor's to judge)."""
        self._read(worker, link, None)

    def _read(self, worker: int, link: Any, over: threading.Event | None) -> None:
        """``worker``'s messages over ``link`` until it is lost or its link fails; a joiner's
        (``over`` None) until it is done too, one of the run's own until the chief's word that
        the run is over (which sets ``over``)."""
        server = self.server
        message = torch.zeros_like(server.messages[0])
        while worker not in server.lost and (over is not None or worker not in server.done):
            try:
                link.irecv(blank(message), TAG_MESSAGE + server.tags).wait()
            except RuntimeError:
                return
            header = self.validated(worker, message)
            if header is not None and not server._handle(worker, message, header, self.section(worker, header)):
                if over is not None:
                    over.set()
                return

    def section(self, worker: int, header: Header) -> torch.Tensor | None:
        """The table section that follows ``header`` from ``worker`` (its length checked by the
        validator), taken within the heartbeat timeout; None when the header states none."""
        if not header.extra:
            return None
        server = self.server
        section = torch.empty(header.extra, dtype=torch.uint8)
        work = server.links[worker].irecv(section, TAG_SECTION + server.tags)
        try:
            work.wait(timedelta(seconds=server.watch.heartbeat_timeout))
        except RuntimeError:
            return torch.empty(0, dtype=torch.uint8)  # cut short: refused as such when read
        return section

    def validated(self, worker: int, message: torch.Tensor) -> Header | None:
        """``message``'s header, or None for a message the shard refuses (validator.py)."""
        with self.server.lock:
            try:
                return self.server.validator.check(self.server, worker, message)
            except Malformed as refusal:
                self.refuse(worker, refusal.reason)
                return None

    def refuse(self, worker: int, reason: str) -> None:
        """Count a refused message (the shard's lock held); drop its sender if it joined, end
        the run if it is one of the run's own workers (a broken rank)."""
        server = self.server
        fatal = server.validator.refuse(server, worker, reason)
        if fatal is not None:
            server.fatal = fatal
            server.finished.set()
        elif worker in server.joined and worker in server.active_workers():
            server._lose(worker, f"it sent a message the shard refuses: {reason}")
            server._progress()
