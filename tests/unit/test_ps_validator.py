"""A parameter-server shard survives any message: one it refuses changes nothing but a
count, and the run it serves ends as it would have without it. Driven in one process over
the protocol's in-memory link (protocol/memory.py), with the production wire and validator."""

import math
import os
import random
import threading
import time

import pytest
import torch
from torch import nn

from paratrain.comm.codec_config import CodecConfig, make_codec
from paratrain.comm.packing import PackedGradient
from paratrain.strategies.ps.modes import MODES, PSConfig, PSMode
from paratrain.strategies.ps.protocol.client import ShardClient
from paratrain.strategies.ps.protocol.memory import MemoryLink
from paratrain.strategies.ps.protocol.server import ShardServer
from paratrain.strategies.ps.protocol.wire import (
    DONE,
    HEADER_BYTES,
    HEADER_SIZE,
    MAGIC,
    PULL,
    PUSH,
    SHUTDOWN,
    TAG_MESSAGE,
    Header,
    Malformed,
    message_buffer,
)

BAD_MESSAGES = 1200  # the floor is 1,000 a run
STEPS = 12


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _server(mode, workers=0, round_of=1, heartbeat_timeout=5.0):
    """A shard of one shard; ``workers``: the run's own (ranks), ``round_of``: the gradients
    a synchronous round takes."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rule = MODES[mode].make_rule(PSConfig(), round_of)
    return ShardServer(
        0,
        1,
        workers,
        model,
        optimizer,
        rule,
        store=None,
        heartbeat_timeout=heartbeat_timeout,
        tolerate_loss=True,
        wait_timeout=5.0,
    )


def _client(server, worker):
    """A worker that joined the shard over its own link, and its client."""
    worker_end, shard_end = MemoryLink.pair()
    server.admit(worker, shard_end)
    layout = server.layout
    packers = [PackedGradient(make_codec("none"), lambda: make_codec("none"), layout.piece_shapes(0))]
    pulled = torch.zeros(layout.total)
    client = ShardClient(
        worker, [worker_end], layout, packers, pulled, tags=0, store=None, backup_workers=0, timeout=5.0
    )
    return client, pulled


def _message(server, header, payload=None):
    """A whole, well-formed message (a push's payload: ``payload``, else its gradient's zeros)."""
    message = message_buffer(server.packer.nbytes)
    size = 0
    if header.has_payload:
        size = server.packer.nbytes
        flat = payload if payload is not None else torch.zeros(server.layout.total)
        server.packer.compress_into(flat, message[HEADER_BYTES : HEADER_BYTES + size])
    return header.write(message, size).clone()


FLAG_FIELDS = (8, 11, 14, 15)


def _bad(rng, server):
    """A message no worker of the run may send now, and the outcome it must have:
    ``"refused"``, or ``"skipped"`` (a push whose payload holds a NaN though its header says
    finite: the update is skipped, as --on-nan skip does). ``"stale"`` is a whole pull (a
    reply, nothing else) and then a push cut short, which lands on the pull's bytes."""
    full = server.packer.nbytes
    push = Header(PUSH, version=server.version, samples=8)
    kind = rng.choice(["garbage", "version", "field", "cut", "stale", "future", "pull", "batch", "shutdown", "nan"])
    if kind == "garbage":  # random bytes, of any length the buffer takes
        data = torch.randint(0, 256, (rng.randint(1, HEADER_BYTES + full + 8),), dtype=torch.uint8)
        if data.numel() >= 4 and data[:4].view(torch.float32).item() == MAGIC:
            data[0] ^= 1
        return data, "refused"
    if kind == "version":  # another version of the protocol
        message = _message(server, push)
        message[:4].view(torch.float32).fill_(MAGIC + rng.choice([-1, 1, 100]))
        return message, "refused"
    if kind == "field":  # one field out of its range
        message = _message(server, push)
        index = rng.randrange(1, HEADER_SIZE)
        if index in FLAG_FIELDS:
            value = rng.choice([2.0, 0.5, -1.0, math.nan])
        elif index == 7:  # the learning-rate factor
            value = rng.choice([-0.5, -1.0, math.inf, math.nan, 1e9])
        elif index == 6:  # the examples
            value = rng.choice([0.0, -3.0, 0.5, float(1 << 25), math.nan])
        else:
            value = rng.choice([-1.0, 0.5, math.inf, -math.inf, math.nan])
        message[:HEADER_BYTES].view(torch.float32)[index] = value
        return message, "refused"
    if kind in ("cut", "stale"):  # a whole message cut short
        message = _message(server, push)
        return message[: rng.randint(1, message.numel() - 1)].clone(), kind
    if kind == "future":  # a push on a version the shard has not published
        return _message(server, Header(PUSH, version=server.version + rng.randint(1, 10**6), samples=8)), "refused"
    if kind == "pull":  # for a version beyond any in flight
        return _message(server, Header(PULL, wanted=server.version + 10**7 + rng.randint(0, 10**6))), "refused"
    if kind == "batch":  # a batch of an epoch the run is not in
        return _message(server, Header(PULL, batch=(rng.randint(2, 10**5), rng.randint(1, 10**6)))), "refused"
    if kind == "shutdown":  # only the chief ends the run
        return _message(server, Header(SHUTDOWN)), "refused"
    return _message(server, push, torch.full((server.layout.total,), math.nan)), "skipped"


def _train(server, bad_per_step=0, rng=None, send_bad=None):
    """Worker 0's pushes, from one process's gradients, with ``bad_per_step`` bad messages
    from others before each (``send_bad(server, rng, expected)`` sends one; default: over
    in-process links); its parameters at the end."""
    send_bad = send_bad or _send_bad
    client, pulled = _client(server, 0)
    reference = _model()
    client.post_reply()
    client.send(Header(PULL, wants_reply=True))
    assert client.await_reply()
    generator = torch.Generator().manual_seed(1)
    expected = {"refused": 0, "skipped": 0}
    for step in range(1, STEPS + 1):
        for _ in range(bad_per_step):
            send_bad(server, rng, expected)
        deadline = time.monotonic() + 20
        while (
            sum(server.validator.refused.values()) < expected["refused"]
            or server.counters.skipped < expected["skipped"]
        ):
            assert time.monotonic() < deadline, (dict(server.validator.refused), server.counters.skipped, expected)
            time.sleep(0.01)
        inputs, targets = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        reference.zero_grad()
        nn.functional.cross_entropy(reference(inputs), targets).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        client.post_reply()
        client.send(Header(PUSH, samples=8, wants_reply=True), grad)
        assert client.await_reply() and client.versions == [step], (client.versions, dict(server.validator.refused))
    client.send(Header(DONE))
    client.drain()
    return pulled.clone(), expected


_next_id = iter(range(1, 10**9))


def _send_bad(server, rng, expected):
    """One bad message, from a worker that joined for it or from a sender that is no worker."""
    message, outcome = _bad(rng, server)
    sender, shard_end = MemoryLink.pair(timeout=0.5)
    worker = next(_next_id)
    stranger = rng.random() < 0.1  # no worker of the run: its messages reach the validator all the same
    if stranger:
        outcome = "refused"
    # Queued before the shard reads the link: its 0.5 s receive never waits on this thread,
    # which a loaded machine may hold back longer.
    if outcome == "stale":
        sender.isend(_message(server, Header(PULL)), TAG_MESSAGE)
    sender.isend(message, TAG_MESSAGE)
    if outcome == "skipped":
        sender.isend(_message(server, Header(DONE)), TAG_MESSAGE)
    if stranger:
        threading.Thread(target=server.receiving.joined, args=(10**6 + worker, shard_end), daemon=True).start()
    else:
        server.admit(worker, shard_end)
    expected["skipped" if outcome == "skipped" else "refused"] += 1


def _resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_shard_refuses_a_thousand_bad_messages_and_trains_as_without_them():
    seed = int(os.environ.get("PARATRAIN_FUZZ_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (PARATRAIN_FUZZ_SEED={seed} repeats it)")
    clean, _ = _train(_server(PSMode.ASYNC))
    server = _server(PSMode.ASYNC)
    before = _resident_bytes()
    fuzzed, expected = _train(server, bad_per_step=BAD_MESSAGES // STEPS, rng=random.Random(seed))
    assert torch.equal(fuzzed, clean)  # the same parameters, bit for bit
    refused = dict(server.validator.refused)
    assert sum(refused.values()) == expected["refused"] and server.counters.skipped == expected["skipped"]
    assert server.statistics()["rejected_messages"] == refused and len(refused) >= 8, refused
    assert server.version == STEPS and not server.fatal
    # bounded: nothing kept per refused message but a count, whatever it claimed
    assert len(server._waiting) == 0 and len(server._held) == 0 and len(server.batch_dealer.num_batches) == 0
    deadline = time.monotonic() + 10  # the last joiners' own threads see them done or dropped
    while not server.active_workers() <= {0}:
        assert time.monotonic() < deadline, server.active_workers()
        time.sleep(0.01)
    assert _resident_bytes() - before < 64 << 20


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda s: _message(s, Header(PUSH, version=0, samples=8)), "a second push to the same round"),
        (lambda s: _message(s, Header(PULL, wants_reply=True)), "a second request before the reply to the first"),
    ],
)
def test_a_second_message_for_the_same_round_is_refused_and_its_joiner_dropped(make, reason):
    server = _server(PSMode.SYNC, round_of=2)
    _client(server, 0)  # the round waits for worker 0
    other, _ = _client(server, 1)
    other.send(Header(PUSH, samples=8, wants_reply=True), torch.zeros(server.layout.total))
    deadline = time.monotonic() + 5
    while not server._held:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other.links[0].isend(make(server), TAG_MESSAGE)
    while 1 not in server.lost:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.validator.refused == {reason: 1} and server.version == 0 and not server.fatal


def test_a_rank_of_the_run_that_sends_a_bad_message_ends_the_run_naming_it():
    server = _server(PSMode.ASYNC, workers=2)
    header = server.receiving.validated(1, _message(server, Header(PUSH, version=7, samples=8)))
    assert header is None and server.finished.is_set()
    assert server.fatal == (
        "ps shard 0: worker 1 (rank 2) sent a message the shard refuses "
        "(a push on a version the shard has not published); the rank is broken"
    )


def test_a_payload_that_does_not_decode_is_refused():
    """Top-k's payload names indices: one beyond the shard's slice decodes to nothing."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = MODES[PSMode.ASYNC].make_rule(PSConfig(), 1)
    options = CodecConfig(compression="topk", compression_ratio=0.5)
    server = ShardServer(
        0,
        1,
        0,
        model,
        optimizer,
        rule,
        store=None,
        heartbeat_timeout=5.0,
        tolerate_loss=True,
        wait_timeout=5.0,
        codec_factory=lambda: make_codec("topk", options),
    )
    message = _message(server, Header(PUSH, samples=8))
    values = server.packer.layouts[0].tensors[0][2]  # the first piece's values, then its indices
    message[HEADER_BYTES + values : HEADER_BYTES + values + 4].view(torch.int32)[0] = 1 << 30
    sender, shard_end = MemoryLink.pair(timeout=0.5)
    server.admit(1, shard_end)
    sender.isend(message, TAG_MESSAGE)
    deadline = time.monotonic() + 5
    while 1 not in server.lost:
        assert time.monotonic() < deadline, dict(server.validator.refused)
        time.sleep(0.01)
    assert server.validator.refused == {"a payload that does not decode": 1} and server.version == 0


def test_a_header_of_another_version_or_cut_short_is_malformed():
    server = _server(PSMode.ASYNC)
    message = _message(server, Header(PUSH, samples=8))
    assert Header.read(message, server.packer.nbytes).samples == 8
    with pytest.raises(Malformed, match="cut short"):
        cut = torch.cat([message[:HEADER_BYTES], torch.zeros(server.packer.nbytes + 8, dtype=torch.uint8)])
        Header.read(cut, server.packer.nbytes)
    message[:4].view(torch.float32).fill_(MAGIC - 1)
    with pytest.raises(Malformed, match="not this protocol or version"):
        Header.read(message, server.packer.nbytes)


def test_a_payload_of_any_length_is_framed():
    """fp16's payload of 3 parameters is 6 bytes: the trailer lands at an offset no float32
    view may start at, and is written and read byte-wise."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = MODES[PSMode.ASYNC].make_rule(PSConfig(), 1)
    options = CodecConfig(compression="fp16")
    server = ShardServer(
        0,
        1,
        0,
        model,
        optimizer,
        rule,
        store=None,
        heartbeat_timeout=5.0,
        tolerate_loss=True,
        wait_timeout=5.0,
        codec_factory=lambda: make_codec("fp16", options),
    )
    assert server.packer.nbytes == 6
    message = _message(server, Header(PUSH, samples=8), torch.tensor([1.0, 2.0, 3.0]))
    assert Header.read(message, 6).samples == 8
    server.workers.add(0)
    assert server.receiving.validated(0, torch.cat([message, torch.zeros(2, dtype=torch.uint8)])) is not None


class _TableShard:
    """What the validator reads of a shard that holds table rows (a push brings a section)."""

    shard = 0
    num_shards = 1
    num_workers = 1
    version = 3
    joined = []
    workers = {0}

    def request_of(self, worker):
        return False

    def holds_push_of(self, worker):
        return False

    def epochs_dealt(self):
        return {}

    def deals(self):
        return False

    def section_bound(self, header):
        return 64 if header.has_payload else 0


def test_a_table_shard_refuses_a_push_without_its_table_section():
    """A push in time to a shard of tables must bring its rows' section: one that says none
    is refused by the validator (it crashed the shard where its rows were read)."""
    from paratrain.strategies.ps.protocol.validator import MessageValidator

    payload = 16
    validator, shard = MessageValidator(payload), _TableShard()

    def message(extra):
        return Header(PUSH, version=3, samples=8, extra=extra).write(message_buffer(payload), payload).clone()

    assert validator.check(shard, 0, message(8)).extra == 8
    with pytest.raises(Malformed, match="a push without its table section"):
        validator.check(shard, 0, message(0))


def test_an_epochs_first_pull_asks_each_shard_for_the_version_it_last_sent():
    """Under ps-async the shards' versions part (one drops or skips a push another applies):
    the pull that starts an epoch asks each shard for its own last version, which its validator
    takes, and not shard 0's, which a shard 60 versions behind refused as beyond any in
    flight (a rank of the run sending it, the run ended)."""
    from paratrain.strategies.ps.layout import ShardLayout
    from paratrain.strategies.ps.protocol.validator import MessageValidator

    class Captured:
        def __init__(self):
            self.sent = []

        def isend(self, tensor, tag):
            self.sent.append(tensor.clone())
            return type("Sent", (), {"wait": lambda self, timeout=None: True})()

    layout = ShardLayout([p.shape for p in _model().parameters()], 2)
    packers = [PackedGradient(make_codec("none"), lambda: make_codec("none"), layout.piece_shapes(s)) for s in (0, 1)]
    links = [Captured(), Captured()]
    client = ShardClient(
        0, links, layout, packers, torch.zeros(layout.total), tags=0, store=None, backup_workers=0, timeout=5.0
    )
    client.versions = [80, 20]
    client.send(Header(PULL, wants_reply=True), wanted_seen=True)
    for shard, (link, version) in enumerate(zip(links, client.versions)):
        received = message_buffer(packers[shard].nbytes)  # the shard's receive buffer
        received[: link.sent[0].numel()] = link.sent[0]
        header = Header.read(received, packers[shard].nbytes)
        assert (header.version, header.wanted) == (version, version)
        seen = _TableShard()
        seen.version = version
        assert MessageValidator(packers[shard].nbytes).check(seen, 0, received).wanted == version
