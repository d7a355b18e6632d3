"""The input pipeline: per-batch transforms, their seeding, prefetching, loader wait time."""

import threading
import time

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.data.sharding import ShardedBatches, TransformedTensors, prefetched
from paratrain.models import build_model
from paratrain.train.callbacks import Callback


def noisy(inputs, generator):
    """A random transform: adds noise drawn from the pipeline's generator."""
    return inputs.float() + torch.rand(inputs.shape, generator=generator)


def _data(n=64):
    return TransformedTensors(torch.arange(n, dtype=torch.uint8).unsqueeze(1), torch.arange(n), noisy)


def _epoch(batches, epoch=0):
    batches.set_epoch(epoch)
    return [x.clone() for x, _ in batches]


def test_the_data_sets_transform_applies_to_every_batch():
    batches = ShardedBatches(_data(), 8, seed=1)
    for x, y in batches:
        assert x.dtype == torch.float32
        assert torch.all((x.squeeze(1) - y.float() >= 0) & (x.squeeze(1) - y.float() < 1))


def test_transform_randomness_is_seeded_per_seed_epoch_and_rank():
    def run(seed=1, rank=0, epoch=0):
        return _epoch(ShardedBatches(_data(), 8, num_replicas=2, rank=rank, seed=seed), epoch)

    first = run()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))  # reproducible
    for other in (run(seed=2), run(rank=1), run(epoch=1)):
        assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_prefetched_batches_are_the_batches_read_inline():
    inline = _epoch(ShardedBatches(_data(), 8, seed=3, prefetch=0))
    ahead = _epoch(ShardedBatches(_data(), 8, seed=3, prefetch=2))
    assert len(inline) == len(ahead) == 8
    assert all(torch.equal(a, b) for a, b in zip(inline, ahead))


def test_an_explicit_transform_overrides_the_data_sets():
    batches = ShardedBatches(_data(), 8, shuffle=False, transform=lambda x, g: x.float() * 2)
    x, y = next(iter(batches))
    assert torch.equal(x.squeeze(1), y.float() * 2)


def test_plain_tensors_are_read_without_a_thread(monkeypatch):
    monkeypatch.setattr("paratrain.data.sharding.prefetched", lambda *a: pytest.fail("prefetched plain tensors"))
    x, y = load_digits().train.tensors
    assert len(list(ShardedBatches((x, y), 32))) == 1437 // 32


def test_prefetch_overlaps_preparation_with_the_step_and_wait_is_measured():
    def slow(inputs, generator):
        time.sleep(0.05)
        return inputs.float()

    def consume(prefetch):
        batches = ShardedBatches(_data(48), 8, transform=slow, prefetch=prefetch)
        for _ in batches:
            time.sleep(0.1)  # the "step", longer than preparing a batch
        return batches.wait_seconds

    inline, ahead = consume(0), consume(2)
    assert inline >= 6 * 0.05 * 0.9  # every batch prepared while the loop waited
    assert ahead < 0.05 + 5 * 0.02  # only the first batch waited for
    assert ahead < inline / 2


def test_an_error_in_the_producer_reaches_the_consumer():
    def failing():
        yield 1
        raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        list(prefetched(failing()))


def test_a_consumer_that_stops_early_stops_the_producer():
    before = threading.active_count()
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    items = prefetched(endless(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert threading.active_count() == before
    assert len(produced) <= 3 + 2 + 1  # at most the queue's depth ahead


def test_trainer_reports_loader_wait_and_stops_mid_epoch():
    class StopAt(Callback):
        def on_batch_end(self, step, logs):
            if step == 5:
                self.trainer.stop_training = True

    splits = load_digits()
    x, y = splits.train.tensors
    data = TransformedTensors((x * 16).to(torch.uint8), y, lambda inputs, g: inputs.float() / 16)
    torch.manual_seed(0)
    model = build_model("mlp", splits.spec)
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.05),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
    )
    history = trainer.fit(data, epochs=3, verbose=0, callbacks=[StopAt()])
    assert trainer.global_step == 5 and len(history.epochs) == 1
    assert history["loader_wait_seconds"][0] > 0
    assert trainer.loader_wait_seconds == pytest.approx(history["loader_wait_seconds"][0])
