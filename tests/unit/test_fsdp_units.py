"""Which modules fsdp shards as units of their own (no processes needed)."""

import pytest
from torch import nn

from paratrain.parallel.sharding import fsdp_units


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_each_module_with_parameters_is_a_unit_but_tied_ones_stay_with_the_root():
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert fsdp_units(mlp) == [mlp[0], mlp[2]]
    tied = Tied()
    assert fsdp_units(tied) == [tied.mix]


def test_a_model_that_names_its_blocks_is_sharded_block_by_block():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=3, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert fsdp_units(model) == list(model.transformer.h)  # wte, wpe, ln_f and the tied lm_head: the root's
