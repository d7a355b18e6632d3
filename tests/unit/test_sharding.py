import pytest
import torch

from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError


def _data(n=103):
    return torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_replica_batches_are_disjoint_and_form_the_single_process_batch(replicas):
    data, batch = _data(), 5
    single = ShardedBatches(data, batch * replicas, seed=7)
    shards = [ShardedBatches(data, batch, num_replicas=replicas, rank=r, seed=7) for r in range(replicas)]
    for epoch in (0, 1):
        single.set_epoch(epoch)
        for shard in shards:
            shard.set_epoch(epoch)
        assert all(len(s) == len(single) for s in shards)
        for step, (_, targets) in enumerate(single):
            parts = [list(shard)[step][1] for shard in shards]
            joined = torch.cat(parts)
            assert joined.tolist() == targets.tolist()
            assert len(set(joined.tolist())) == len(joined)


def test_epochs_reshuffle_and_seed_repeats():
    a = ShardedBatches(_data(), 10, seed=1)
    first = [t.tolist() for _, t in a]
    a.set_epoch(1)
    assert [t.tolist() for _, t in a] != first
    assert [t.tolist() for _, t in ShardedBatches(_data(), 10, seed=1)] == first


def test_evaluation_split_covers_every_example_once():
    seen = []
    for rank in range(3):
        seen += [
            t
            for _, y in ShardedBatches(_data(), 8, num_replicas=3, rank=rank, shuffle=False, drop_last=False)
            for t in y.tolist()
        ]
    assert sorted(seen) == list(range(103))


@pytest.mark.parametrize(
    ("n", "replicas", "batch"), [(513, 2, 256), (103, 3, 8), (1025, 4, 256), (10, 4, 3), (3, 4, 2), (1, 2, 5)]
)
def test_evaluation_gives_every_replica_as_many_batches_of_at_most_the_batch_size(n, replicas, batch):
    # fsdp's shards all-gather in every forward: a replica with one batch fewer would hang the others
    shards = [
        ShardedBatches(_data(n), batch, num_replicas=replicas, rank=r, shuffle=False, drop_last=False)
        for r in range(replicas)
    ]
    batches = [[y.tolist() for _, y in shard] for shard in shards]
    assert len({len(b) for b in batches}) == 1, [len(b) for b in batches]
    assert [len(b) for b in batches] == [len(shard) for shard in shards]
    assert all(0 < len(y) <= batch for b in batches for y in b if n >= replicas)
    assert all(len(y) <= batch for b in batches for y in b)  # fewer examples than replicas: some empty
    assert sorted(t for b in batches for y in b for t in y) == list(range(n))


@pytest.mark.parametrize("batches, size, replicas", [(5, 4, 2), (7, 3, 3), (2, 5, 4), (4, 2, 3), (3, 1, 2)])
def test_a_stream_in_evaluation_gives_every_replica_as_many_batches_and_every_example_once(batches, size, replicas):
    stream = [
        (torch.arange(b * size, (b + 1) * size).unsqueeze(1), torch.arange(b * size, (b + 1) * size))
        for b in range(batches)
    ]
    dicts = [{"x": x, "labels": y} for x, y in stream]  # a datasets-style dict batch: both inputs and targets
    for data, label in ((stream, lambda pair: pair[1]), (dicts, lambda pair: pair[1]["labels"])):
        shards = [
            ShardedBatches(data, 99, num_replicas=replicas, rank=r, shuffle=False, drop_last=False)
            for r in range(replicas)
        ]
        taken = [list(shard) for shard in shards]
        assert {len(t) for t in taken} == {len(shards[0])} == {batches // replicas + batches % replicas}
        seen = torch.cat([label(pair) for t in taken for pair in t])
        assert sorted(seen.tolist()) == list(range(batches * size))


def test_global_batch_larger_than_data_is_bad_input():
    with pytest.raises(ConfigError, match="larger than the data set"):
        ShardedBatches(_data(10), 8, num_replicas=2)


def test_generic_dataset_goes_through_a_dataloader():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return torch.tensor([float(i)]), i * i

    batches = list(ShardedBatches(Squares(), 4, shuffle=False))
    assert len(batches) == 5
    assert batches[1][1].tolist() == [16, 25, 36, 49]


def test_one_replica_reads_a_stream_without_len_to_its_end():
    """``len()`` is needed only where several replicas must agree on an epoch's steps: one
    replica takes every batch of a stream that has none (it was refused as having None)."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.full((4, 3), float(k)), torch.zeros(4, dtype=torch.long)) for k in range(5)])

    batches = ShardedBatches(Stream(), 4, num_replicas=1, rank=0, drop_last=True)
    assert [int(x[0, 0]) for x, _ in batches] == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="has no len\\(\\): with 2 replicas"):
        ShardedBatches(Stream(), 4, num_replicas=2, rank=0, drop_last=True)
