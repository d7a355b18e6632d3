"""An in-process link between a shard and a worker (links.py's interface), for tests and
tools that drive the protocol without processes: a receive waits for its message, and a
message shorter than the posted buffer fills its front, as over Gloo. Messages keep their
order per tag."""

from __future__ import annotations

import queue
import threading

import torch


class _Sent:
    def wait(self, timeout: object = None) -> bool:
        return True


class _Receive:
    def __init__(self, inbox: queue.Queue, tensor: torch.Tensor, timeout: float):
        self.inbox = inbox
        self.tensor = tensor
        self.timeout = timeout

    def wait(self) -> bool:
        try:
            message = self.inbox.get(timeout=self.timeout)
        except queue.Empty:
            raise RuntimeError("Timed out waiting for the message") from None
        if message.numel() * message.element_size() > self.tensor.numel() * self.tensor.element_size():
            # Gloo ends the receiving process then (EnforceNotMet in its I/O thread); the
            # protocol never sends one (a joiner of another version is refused before it joins).
            raise RuntimeError("message larger than the posted buffer")
        self.tensor.view(-1).view(torch.uint8)[: message.numel() * message.element_size()].copy_(
            message.reshape(-1).view(torch.uint8)
        )
        return True


class _Boxes(dict):
    def __init__(self, lock: threading.Lock):
        super().__init__()
        self.lock = lock

    def __missing__(self, tag: int) -> queue.Queue:
        with self.lock:
            return self.setdefault(tag, queue.Queue())


class MemoryLink:
    """One end of a link; ``pair()`` makes both."""

    def __init__(self, outboxes: dict, inboxes: dict, timeout: float = 5.0):
        self.outboxes = outboxes
        self.inboxes = inboxes
        self.timeout = timeout

    @staticmethod
    def pair(timeout: float = 5.0) -> tuple[MemoryLink, MemoryLink]:
        lock = threading.Lock()
        a_to_b, b_to_a = _Boxes(lock), _Boxes(lock)
        return MemoryLink(a_to_b, b_to_a, timeout), MemoryLink(b_to_a, a_to_b, timeout)

    def isend(self, tensor: torch.Tensor, tag: int) -> _Sent:
        self.outboxes[tag].put(tensor.detach().clone())
        return _Sent()

    def irecv(self, tensor: torch.Tensor, tag: int) -> _Receive:
        return _Receive(self.inboxes[tag], tensor, self.timeout)
