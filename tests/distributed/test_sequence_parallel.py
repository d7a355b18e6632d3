"""tensor's sequence parallelism (--sequence-parallel, parallel/sequence.py): the activations
between the split layers held split by position. The built-in gpt split 2 ways that way
equals one process of the same global batch step by step, its norms see a process's
positions only (the test fails if they see all), and its norms' replicated weights get the
gradient of every position (summed over the processes); a length the processes do not
divide, and a plan with no place to split, are one line."""

import pytest
import torch

import paratrain
from paratrain.errors import ConfigError
from paratrain.testing import relative_difference, run_distributed
from tests.conftest import SEQUENCE_PACKED_TP
from tests.distributed.test_tensor_loss import SEQ, B, _train, _width, gpt

# The built-in gpt's attention is one packed projection (qkv): its split by position needs 2.13
pytestmark = [pytest.mark.distributed, SEQUENCE_PACKED_TP]


def _sequence(workers=2, loss_parallel=True):
    """The gpt under tensor T=2 with sequence parallelism; what its norms were given."""
    strategy = paratrain.TensorParallelStrategy(
        2, sequence_parallel=True, loss_parallel=loss_parallel, device="cpu", workers=workers
    )
    seen = set()
    build = _watching_norms(seen)
    return (*_train(strategy, build), seen)


def _watching_norms(seen):
    def build():
        model = gpt()
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.register_forward_hook(lambda m, i, out: seen.add(_width(out)) if m.training else None)
        return model

    return build


@pytest.mark.parametrize("loss_parallel", [True, False], ids=["split-logits", "whole-logits"])
def test_the_gpt_split_by_position_equals_one_process(loss_parallel):
    """Each step's loss (SGD, float32) and every parameter after the steps, the norms' weights
    among them, equal one process's to 1e-5: a norm's weight that got only its process's
    positions' gradient would be off by half. Each norm computed on (B, SEQ/2, width)."""
    reference, single_losses, single_tested, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"))
    for params, losses, tested, _, sent, seen in run_distributed(_sequence, 1, loss_parallel, world_size=2):
        assert losses == pytest.approx(single_losses, rel=1e-5)
        assert relative_difference(params, reference) < 1e-5
        assert tested["loss"] == pytest.approx(single_tested["loss"], rel=1e-5)
        assert seen == {("DTensor", (B, SEQ // 2, 32))}  # what this process computed, of (B, SEQ, 32)
        assert sent > 0


def test_a_plan_with_nowhere_to_split_and_a_length_that_does_not_divide_are_one_line():
    from paratrain.config import TrainConfig

    with pytest.raises(ConfigError, match="--seq-len 63 is not a multiple of 2"):
        TrainConfig(strategy="tensor", model="gpt", dataset="text-lm", seq_len=63, sequence_parallel=True)
    plan = '{"*.attention.qkv": "colwise:3", "*.attention.out": "rowwise"}'
    result = run_distributed(_refused, plan, world_size=2)
    assert all("names no module whose output to split by position" in message for message in result)


def _refused(plan):
    import json

    strategy = paratrain.TensorParallelStrategy(2, plan=json.loads(plan), sequence_parallel=True, device="cpu")
    model = gpt()
    try:
        paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    except ConfigError as error:
        return str(error)
    finally:
        strategy.teardown()
    return "not refused"
