"""Stage splits and layer placement on one process (CPU "devices")."""

import pytest
import torch
from torch import nn

import paratrain.parallel as parallel
from paratrain.config import TrainConfig
from paratrain.errors import ConfigError
from paratrain.parallel.split import balanced_bounds, bounds_from_split_points, parse_split_points


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_bounds([8, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert balanced_bounds([0, 16640, 0, 2570], 2) == [(0, 2), (2, 4)]  # the digits MLP
    bounds = balanced_bounds([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 8 and all(a < b for a, b in bounds)
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][a:b]) for a, b in bounds) == 14  # [3,1,4,1,5] [9,2] [6]


def test_split_points_name_where_stages_start():
    assert bounds_from_split_points([3, 7], 10) == [(0, 3), (3, 7), (7, 10)]
    assert parse_split_points("3, 7") == [3, 7]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: balanced_bounds([1, 1], 3), ["--stages 3", "2 layers"]),
        (lambda: bounds_from_split_points([0], 4), ["leaves a stage empty"]),
        (lambda: bounds_from_split_points([2, 2], 4), ["leaves a stage empty"]),
        (lambda: bounds_from_split_points([4], 4), ["leaves a stage empty"]),
        (lambda: parse_split_points("2,h.3"), ["--split-points", "3,7", "transformer.h.2"]),
        (lambda: parse_split_points(" , "), ["--split-points", "3,7"]),
        (lambda: parallel.place(nn.LSTM(2, 2), ["cpu"]), ["nn.Sequential"]),
    ],
)
def test_bad_splits_are_config_errors(call, words):
    with pytest.raises(ConfigError) as error:
        call()
    assert all(w in str(error.value) for w in words)


def test_placed_model_equals_the_original_in_outputs_and_gradients():
    x = torch.randn(16, 64)
    reference = _model()
    want = reference(x)
    want.sum().backward()
    placed = parallel.place(_model(), devices=["cpu", "cpu", "cpu"])
    assert len(placed.parts) == 3 and [b for b in placed.bounds] == balanced_bounds(
        [float(sum(p.numel() for p in l.parameters())) for l in _model()], 3
    )
    got = placed(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for a, b in zip(placed.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"stages": 1}, ["--stages S >= 2"]),
        ({"workers": 3}, ["--workers 3 is not a multiple of --stages 2"]),
        ({"microbatches": 5}, ["--batch-size 32", "--microbatches 5"]),
        ({"split_points": "1,2"}, ["3 stages", "--stages is 2"]),
        ({"schedule": "zb"}, ["--schedule", "gpipe, 1f1b"]),
        ({"balance": "time", "split_points": "2"}, ["give one of them"]),
        ({"microbatches": 1}, ["--schedule 1f1b needs --microbatches >= --stages"]),
    ],
)
def test_pipeline_config_errors_name_the_flag(changes, words):
    with pytest.raises(ConfigError) as error:
        TrainConfig(strategy="pipeline", **changes)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_pipeline_options_belong_to_the_pipeline_strategy():
    with pytest.raises(ConfigError, match="--microbatches applies to --strategy pipeline"):
        TrainConfig(strategy="allreduce", workers=2, microbatches=8)
    with pytest.raises(ConfigError, match="--schedule applies to --strategy pipeline"):
        TrainConfig(strategy="ps-sync", workers=2, schedule="gpipe")


def test_pipeline_processes_and_chief():
    topology = TrainConfig(strategy="pipeline", stages=2).topology
    assert topology.num_processes == 2 and topology.chief_rank == 1
    config = TrainConfig(strategy="pipeline", stages=2, workers=4)
    assert config.topology.num_processes == 4
    assert config.global_batch == 2 * config.batch_size  # 2 pipeline replicas read the batch
    assert config.topology.rank_name(3) == "stage 1 of replica 1"


def _tied(vocab=11, width=6):
    embed, head = nn.Embedding(vocab, width), nn.Linear(width, vocab, bias=False)
    head.weight = embed.weight  # tied, as a language model's output layer is
    return nn.Sequential(embed, nn.Linear(width, width), nn.ReLU(), head)


@pytest.mark.parametrize("flags", [{}, {"split_points": "2"}])
def test_tied_layers_may_go_to_different_stages(flags):
    from paratrain.strategies.pipeline.checks import check_pipeline_model

    check_pipeline_model(_tied(), TrainConfig(strategy="pipeline", stages=2, **flags))


def test_a_parameter_two_stages_hold_is_listed_on_both_in_one_order():
    from paratrain.parallel.shared import split_stage

    model = _tied()
    layers, bounds = list(model), [(0, 2), (2, 4)]
    holdings = [[(p, p) for layer in layers[a:b] for p in layer.parameters()] for a, b in bounds]
    first, last = (split_stage(nn.Sequential(), i, holdings, list(model.parameters())) for i in (0, 1))
    shared = model[0].weight
    assert first.shared_by == last.shared_by == [(0, 1)]
    assert first.tied == [([shared], (0, 1))] and last.tied == [([shared], (0, 1))]
    assert len(first.copies) == 3 and len(last.copies) == 1  # embedding, linear's 2; the head's weight
