"""Activation checkpointing (``--activation-checkpointing``): the same gradients, fewer
activations kept for the backward pass."""

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.models.gpt import GPT
from paratrain.models.gpt_config import GPTConfig
from paratrain.strategies.activation import checkpoint_every, saved_activation_bytes
from paratrain.strategies.recipe import StepRecipe
from paratrain.train.scores import cross_entropy_loss


def _gpt(dropout=0.1):
    torch.manual_seed(0)
    return GPT(256, 32, GPTConfig(gpt_layers=4, gpt_width=32, gpt_heads=2, gpt_dropout=dropout))


def _gradients(model, ids, targets):
    torch.manual_seed(1)  # the dropout masks
    model.zero_grad()
    cross_entropy_loss(model(ids), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["blocks", "every-2"])
def test_checkpointed_blocks_give_the_gradients_of_the_whole_model(how):
    """With dropout: the recomputation draws the masks of the first pass."""
    ids, targets = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    plain = _gradients(_gpt(), ids, targets)
    model = StepRecipe(activation_checkpointing=how).prepare_model(_gpt())
    checkpointed = _gradients(model, ids, targets)
    assert len(checkpointed) == len(plain)
    for (name, grad), expected in zip(checkpointed.items(), plain.values()):
        assert torch.allclose(grad, expected, rtol=0, atol=1e-7), name
    assert list(model.state_dict()) == list(_gpt().state_dict())  # checkpoints keep their keys


def test_checkpointing_keeps_fewer_activations_the_more_blocks_it_takes():
    ids, targets = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    kept = {}
    for how in ("none", "every-2", "blocks"):
        model = StepRecipe(activation_checkpointing=how).prepare_model(_gpt(dropout=0.0))
        kept[how] = saved_activation_bytes(lambda m=model: cross_entropy_loss(m(ids), targets), model)
    # 4 blocks: every-2 checkpoints 2 of them, blocks all 4 (the embeddings and head keep theirs)
    assert kept["blocks"] < kept["every-2"] < kept["none"]
    assert kept["blocks"] < 0.5 * kept["none"]


def test_a_sequential_model_checkpoints_its_layers():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    StepRecipe(activation_checkpointing="blocks").prepare_model(model)
    assert [type(m).__name__ for m in model] == ["CheckpointWrapper", "ReLU", "CheckpointWrapper"]


@pytest.mark.parametrize("value", ["some", "every-0", "every-x", "every-"])
def test_a_bad_value_is_one_line_naming_the_valid_ones(value):
    with pytest.raises(ConfigError, match="valid: none, blocks or every-K"):
        TrainConfig(activation_checkpointing=value)
    assert checkpoint_every("every-3") == 3 and checkpoint_every("blocks") == 1 and checkpoint_every("none") == 0


def test_a_model_that_names_no_blocks_is_refused():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x)

    with pytest.raises(ConfigError, match="Plain names no blocks to checkpoint"):
        StepRecipe(activation_checkpointing="blocks").prepare_model(Plain())
