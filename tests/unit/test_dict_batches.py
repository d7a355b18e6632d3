"""Batches that are a dict of tensors alone (as ``datasets`` and tokenizers make them), the
model's own loss, and any indexable object with a length as a map-style data set."""

import pytest
import torch
from torch import nn

from paratrain.data.batch import as_pair
from paratrain.data.sharding import ShardedBatches, is_map_style
from paratrain.errors import ConfigError
from paratrain.train.scores import default_loss, model_loss, resolve_loss


class Rows:
    """Not a torch Dataset: an object with ``__len__`` and ``__getitem__`` of dict examples."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "labels": torch.tensor(i)}


def test_an_indexable_object_is_map_style_and_its_dict_examples_are_batches():
    assert is_map_style(Rows(4)) and not is_map_style([(torch.zeros(1), torch.zeros(1))])
    assert not is_map_style(torch.zeros(4, 2)) and not is_map_style({"x": torch.zeros(2)})
    replicas = [ShardedBatches(Rows(8), 2, shuffle=False, drop_last=True, rank=r, num_replicas=2) for r in range(2)]
    for r, batches in enumerate(replicas):
        batches.set_epoch(0)
        firsts = [inputs["x"][:, 0].tolist() for inputs, targets in batches]
        assert all(inputs["labels"] is targets["labels"] for inputs, targets in batches)  # the batch is its own target
        assert firsts == [[4.0 * k + 2 * r, 4.0 * k + 2 * r + 1] for k in range(2)]  # blocks of each global batch


def test_a_huggingface_dataset_is_read_as_tensors():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "labels": [[1, 2], [3, 4], [5, 6]]})
    batches = ShardedBatches(data, 3, shuffle=False, drop_last=False)
    batches.set_epoch(0)
    (inputs, targets), *rest = list(batches)
    assert not rest and torch.equal(inputs["input_ids"], torch.tensor([[1, 2], [3, 4], [5, 6]]))


def test_the_model_loss_is_taken_from_what_the_model_returns():
    loss = torch.tensor(2.5)
    assert model_loss({"loss": loss, "logits": torch.zeros(2)}, {}) is loss
    assert model_loss(type("Out", (), {"loss": loss})(), {}) is loss
    assert model_loss(loss, {}) is loss
    with pytest.raises(ConfigError, match="the model returned Tensor with no loss"):
        model_loss(torch.zeros(4, 3), {})
    assert resolve_loss("model") is model_loss and resolve_loss(None) is default_loss
    logits, targets = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
    assert torch.equal(default_loss(logits, targets), nn.functional.cross_entropy(logits, targets))
    assert default_loss({"loss": loss}, {"labels": targets}) is loss


def test_a_batch_that_is_neither_a_pair_nor_a_dict_is_one_line():
    assert as_pair((1, 2), "here") == (1, 2)
    with pytest.raises(ConfigError, match="here gave a tuple of 3; .* or a dict of tensors alone"):
        as_pair((1, 2, 3), "here")
