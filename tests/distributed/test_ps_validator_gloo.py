"""A parameter-server shard survives a thousand bad messages over a real Gloo link between
processes, as over the in-process link (tests/unit/test_ps_validator.py, whose generator and
worker this uses): a relay process sends each bad message over a two-process Gloo group,
the shard admits a joiner for it on that link and refuses or skips the message, and the
run ends with the parameters of the run without them, bit for bit."""

import os
import random
import struct
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from paratrain.strategies.ps.modes import PSMode
from paratrain.strategies.ps.protocol.links import PairLink
from paratrain.strategies.ps.protocol.wire import DONE, HEADER_BYTES, PULL, Header
from tests.unit.test_ps_validator import BAD_MESSAGES, STEPS, _bad, _message, _server, _train

pytestmark = pytest.mark.distributed

# Reads frames from stdin (the message's length, how many parameters the shard's reply to it
# carries, 0 for none, then its bytes) and sends each to the shard over its end of the pair,
# taking the reply where one comes (a whole pull: a shard's reply is sent only once its
# receiver takes it); a zero length ends it.
RELAY = textwrap.dedent(
    """
    import os, struct, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from paratrain.strategies.ps.protocol.links import PairLink
    from paratrain.strategies.ps.protocol.wire import TAG_MESSAGE, TAG_REPLY, TAG_REPLY_HEADER

    port, tags = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    link = PairLink(store, "fuzz", 1, 60.0)
    frames = sys.stdin.buffer
    while True:
        size, reply = struct.unpack("<II", frames.read(8))
        if size == 0:
            break
        link.isend(torch.frombuffer(bytearray(frames.read(size)), dtype=torch.uint8), TAG_MESSAGE + tags).wait()
        if reply:
            link.irecv(torch.zeros(2, dtype=torch.float64), TAG_REPLY_HEADER + tags).wait()
            link.irecv(torch.zeros(reply), TAG_REPLY + tags).wait()
    print("relayed", flush=True)
    os._exit(0)
    """
)


class GlooSender:
    """Each bad message goes over the one Gloo link, to a joiner admitted on it for it alone;
    the next is sent once that joiner's receiving thread has ended (dropped, or done)."""

    def __init__(self, server):
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.relay = subprocess.Popen(
            [sys.executable, "-c", RELAY, str(self.store.port), str(server.tags)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.link = PairLink(self.store, "fuzz", 0, 60.0)
        self.next_worker = 1
        self.sent = 0

    def _send(self, message, reply=0):
        data = message.contiguous().view(torch.uint8).numpy().tobytes()
        self.relay.stdin.write(struct.pack("<II", len(data), reply) + data)
        self.relay.stdin.flush()
        self.sent += 1

    def __call__(self, server, rng, expected):
        message, outcome = _bad(rng, server)
        before = set(threading.enumerate())
        server.admit(self.next_worker, self.link)
        (receiving,) = set(threading.enumerate()) - before
        self.next_worker += 1
        if outcome == "stale":
            self._send(_message(server, Header(PULL)), reply=server.params.numel())
        self._send(message)
        if outcome == "skipped":
            self._send(_message(server, Header(DONE)))
        expected["skipped" if outcome == "skipped" else "refused"] += 1
        receiving.join(timeout=20)
        assert not receiving.is_alive(), (outcome, message[:HEADER_BYTES])

    def close(self):
        self.relay.stdin.write(struct.pack("<II", 0, 0))
        self.relay.stdin.flush()
        out, err = self.relay.communicate(timeout=60)
        return self.relay.returncode, out.decode(), err.decode()


def test_a_shard_refuses_a_thousand_bad_messages_over_gloo_and_trains_as_without_them():
    seed = int(os.environ.get("PARATRAIN_FUZZ_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (PARATRAIN_FUZZ_SEED={seed} repeats it)")
    clean, _ = _train(_server(PSMode.ASYNC))
    server = _server(PSMode.ASYNC)
    sender = GlooSender(server)
    try:
        fuzzed, expected = _train(server, BAD_MESSAGES // STEPS, random.Random(seed), sender)
    finally:
        code, out, err = sender.close()
    assert code == 0 and "relayed" in out, err[-3000:]
    assert sender.next_worker - 1 == BAD_MESSAGES // STEPS * STEPS
    assert torch.equal(fuzzed, clean)  # the same parameters, bit for bit
    refused = dict(server.validator.refused)
    assert sum(refused.values()) == expected["refused"] and server.counters.skipped == expected["skipped"]
    assert len(refused) >= 8, refused
    assert server.version == STEPS and not server.fatal
    assert len(server._waiting) == 0 and len(server._held) == 0


def test_a_joiner_that_never_takes_its_reply_is_lost_and_holds_the_shard_no_longer_than_a_heartbeat():
    """Over Gloo a send ends only when its receiver takes it. A joiner that asks for the
    parameters and then stops (its host gone) would hold the shard, and every worker with
    it, until Gloo's timeout at its next update; it is lost after the heartbeat timeout."""
    server = _server(PSMode.ASYNC, heartbeat_timeout=1.0)
    sender = GlooSender(server)
    try:
        server.admit(1, sender.link)
        sender._send(_message(server, Header(PULL)))  # asks, and never takes the reply
        deadline = time.monotonic() + 10
        while not server.replies.sending and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        parameters, _ = _train(server)  # worker 0's 12 pushes, each answered within its 5 s
        seconds = time.monotonic() - started
    finally:
        sender.close()
    assert server.lost == {1} and server.version == STEPS and not server.fatal
    assert seconds < 1.0 + 4.0, seconds  # one heartbeat timeout, once; not 60 s, nor 5 s a step
    assert torch.equal(parameters, _train(_server(PSMode.ASYNC))[0])
