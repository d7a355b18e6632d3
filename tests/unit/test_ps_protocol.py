"""The parameter-server protocol without processes: a worker's ShardClient and a
ShardServer in one process, over an in-memory link that behaves as a Gloo pair link does
(protocol/memory.py). The wire is the production one: headers, replies, the codec's payload."""

import pytest
import torch
from torch import nn

from paratrain.comm.codec_config import make_codec
from paratrain.comm.packing import PackedGradient
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.modes import MODES, PSConfig, PSMode
from paratrain.strategies.ps.protocol.client import ShardClient
from paratrain.strategies.ps.protocol.memory import MemoryLink
from paratrain.strategies.ps.protocol.server import ShardServer
from paratrain.strategies.ps.protocol.wire import DONE, HEADER_BYTES, PULL, PUSH, TRAILER_BYTES, Header


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _connect(mode: PSMode, model: nn.Module, optimizer: torch.optim.Optimizer):
    """A shard serving one worker (admitted over its own link, as a joiner is) and that
    worker's client."""
    server = ShardServer(
        0,
        1,
        0,
        model,
        optimizer,
        MODES[mode].make_rule(PSConfig(), 1),
        store=None,
        heartbeat_timeout=5.0,
        tolerate_loss=False,
        wait_timeout=5.0,
    )
    worker_end, shard_end = MemoryLink.pair()
    server.admit(0, shard_end)
    layout = ShardLayout.of(model, 1)
    packers = [PackedGradient(make_codec("none"), lambda: make_codec("none"), layout.piece_shapes(0))]
    pulled = torch.zeros(layout.total)
    client = ShardClient(0, [worker_end], layout, packers, pulled, tags=0, store=None, backup_workers=0, timeout=5.0)
    return server, client, pulled


def _flat_grad(model, inputs, targets):
    model.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "header",
    [
        Header(PUSH, version=3, samples=32, lr_scale=0.5, wants_reply=True, batch=(4, 44)),
        Header(PULL, version=(1 << 24) + 12345, wanted=(1 << 30) + 7, wants_reply=True),
        Header(PUSH, version=9, samples=8, nonfinite=True, late=True),
        Header(DONE),
    ],
)
def test_a_header_reads_back_as_written(header):
    message = torch.zeros(100, dtype=torch.uint8)
    header.write(message)
    assert Header.read(message, 0) == header


@pytest.mark.parametrize("mode", [PSMode.SYNC, PSMode.ASYNC])
def test_a_worker_and_a_shard_train_as_one_process_does(mode):
    """Pull, then pushes of a worker's gradients: after each reply the worker holds the
    shard's new version, and its parameters are those of one process taking the same
    optimizer steps on the same gradients."""
    model, reference = _model(), _model()
    server, client, pulled = _connect(mode, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    expected = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    client.post_reply()
    client.send(Header(PULL, wants_reply=True))
    assert client.await_reply() and client.versions == [0]
    assert torch.equal(pulled, torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        inputs, targets = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        grad = _flat_grad(reference, inputs, targets)
        expected.step()
        client.post_reply()
        client.send(Header(PUSH, samples=8, wants_reply=True), grad)
        assert client.await_reply() and client.versions == [step]
        torch.testing.assert_close(pulled, torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
    client.send(Header(DONE))  # no reply: the shard stops counting on this worker
    assert not client.await_reply()
    client.drain()
    assert server.finished.wait(5.0) and server.done == {0}
    stats = server.statistics()
    assert stats["version"] == 3 and stats["samples"] == 24 and stats["staleness"] == {"0": 3}
    assert stats["bytes_sent"] == 4 * (2 * 8 + 4 * server.layout.total)  # 4 replies: header and parameters


def test_a_nonfinite_push_is_its_header_alone_and_no_update():
    """A gradient with a NaN goes as its header alone; the synchronous round it closes
    publishes a version without an update, as one process skips that step."""
    model = _model()
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    server, client, pulled = _connect(PSMode.SYNC, model, torch.optim.SGD(model.parameters(), lr=0.1))
    client.post_reply()
    client.send(Header(PULL, wants_reply=True))
    client.await_reply()
    sent = client.bytes_sent
    client.post_reply()
    client.send(Header(PUSH, samples=8, wants_reply=True, nonfinite=True), torch.full_like(pulled, float("nan")))
    assert client.bytes_sent - sent == HEADER_BYTES + TRAILER_BYTES
    assert client.await_reply() and client.versions == [1]
    assert torch.equal(pulled, before) and server.counters.skipped == 1
