"""tensor's --loss-parallel without processes: which losses take the logits split by
vocabulary (strategies/tensor/loss.py), the gpt's plan that splits its vocabulary and keeps
its tied output layer one parameter, and the option's flags."""

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.launch.factory import strategy_from_flags
from paratrain.models.gpt import GPT
from paratrain.models.gpt_config import GPTConfig
from paratrain.parallel.tensor import matching, output_layer, plan_for, planned
from paratrain.strategies.tensor.loss import own_loss_splits, takes_split_logits
from paratrain.train.scores import default_loss, model_loss, mse_loss, resolve_loss

PAIR, DICT = torch.zeros(2, dtype=torch.long), {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)}


def users_cross_entropy(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets)


def marked(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets)


marked.loss_parallel = True


@pytest.mark.parametrize(
    ("loss", "targets", "own_splits", "split"),
    [
        (resolve_loss("cross_entropy"), PAIR, False, True),
        (default_loss, PAIR, False, True),  # a pair's default: F.cross_entropy
        (default_loss, DICT, True, True),  # a dict's default: the model's own, a causal LM's
        (default_loss, DICT, False, False),  # ... or a model's own loss not known to be a cross-entropy
        (model_loss, DICT, True, True),
        (model_loss, PAIR, True, False),  # a model's own loss of a pair: whatever the model computes
        (mse_loss, PAIR, True, False),
        (users_cross_entropy, PAIR, True, False),  # a user's loss, unmarked: gathered, not refused
        (marked, PAIR, False, True),  # ... marked loss_parallel: split
    ],
)
def test_which_losses_take_the_logits_split(loss, targets, own_splits, split):
    assert takes_split_logits(loss, targets, own_splits) is split


def test_a_causal_lms_own_loss_takes_split_logits_and_other_models_do_not():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    causal = transformers.GPT2LMHeadModel(config)
    assert own_loss_splits(causal)
    causal.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().pow(2).mean()
    assert not own_loss_splits(causal)  # a loss of the user's own replaces it: not known
    assert not own_loss_splits(transformers.GPT2ForSequenceClassification(config))
    assert not own_loss_splits(nn.Linear(2, 2))


def _gpt(layers=2, vocab=256):
    return GPT(vocab, 16, GPTConfig(gpt_layers=layers, gpt_width=32, gpt_heads=4))


def test_the_gpts_plan_splits_its_vocabulary_and_keeps_the_tied_output_layer():
    """The token embedding by rows and the output layer by output features split the tied
    weight's first dimension alike: both stay in the plan (one parameter, split); the output
    layer is the one whose logits stay split."""
    model = _gpt()
    assert model[-1].output.weight is model[0].token.weight
    chosen = planned(model, plan_for(model), 2)
    assert chosen["0.token"].kind == "rowwise" and chosen["3.output"].gather
    assert output_layer(model, chosen) == "3.output"
    assert output_layer(model, {k: v for k, v in chosen.items() if k != "3.output"}) is None


def test_a_vocabulary_that_does_not_divide_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        matching(_gpt(vocab=250), plan_for(_gpt(vocab=250)), 4)
    assert str(caught.value) == "tensor parallelism over 4 processes: 0.token has 250 input rows, not a multiple of 4"


def test_the_option_is_on_by_default_and_taken_by_tensor_alone():
    assert strategy_from_flags(["--strategy", "tensor"]).loss_parallel is True
    strategy = strategy_from_flags(["--strategy", "tensor", "--no-loss-parallel"])
    assert strategy.loss_parallel is False and strategy.describe()["loss_parallel"] is False
    with pytest.raises(
        ConfigError, match="--no-loss-parallel applies to --strategy tensor, not to --strategy allreduce"
    ):
        strategy_from_flags(["--strategy", "allreduce", "--no-loss-parallel"])
