"""StepRecipe under allreduce and pipeline (2 Gloo processes) against single."""

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.strategies.pipeline.strategy import PipelineStrategy
from paratrain.testing import flat_parameters, relative_difference, run_distributed

pytestmark = pytest.mark.distributed

# Equal runs differ only in the order float32 sums are taken (per-replica means averaged
# by the all-reduce, micro-batches summed, a norm summed stage by stage): a few ulps per
# step, well below 1e-5 after a dozen SGD steps. The pipeline equivalence tests use 1e-5 too.
TOLERANCE = 1e-5
MAX_NORM = 0.5  # the mlp's gradient norm on digits is about 3.4 at the start: clipping is active
FIRST_STAGE_SIZE = 64 * 256 + 256  # mlp: Flatten, Linear | ReLU, Linear by parameter count


def _train_steps(strategy, batch_size, steps, seed=0, on_trainer=None, **recipe):
    """Plain SGD (no momentum, no randomness in the model) for ``steps`` steps."""
    torch.manual_seed(seed)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=strategy, **recipe)
    if on_trainer is not None:
        on_trainer(trainer)
    x, y = splits.train.tensors
    n = steps * batch_size * recipe.get("accumulate", 1) * strategy.num_replicas  # exactly `steps` global batches
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=seed, verbose=0)
    assert trainer.global_step == steps
    return flat_parameters(trainer.module)


def _single(batch_size, steps, **recipe):
    return _train_steps(paratrain.SingleDeviceStrategy(device="cpu"), batch_size, steps, **recipe)


def _initial():
    torch.manual_seed(0)
    return flat_parameters(build_model("mlp", load_digits().spec))


def _first_gradient_norm(batch_size):
    """The norm of the first step's gradient on the first global batch (data order aside)."""
    torch.manual_seed(0)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    x, y = splits.train.tensors
    torch.nn.functional.cross_entropy(model(x[:batch_size]), y[:batch_size]).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


class _CountAllReduces:
    """A DDP communication hook: DDP's own all-reduce, counted per bucket."""

    def __init__(self):
        self.calls = 0

    def install(self, trainer):
        trainer.model.register_comm_hook(self, _counting_allreduce)


def _counting_allreduce(state, bucket):  # noqa: ANN001 - DDP checks the real annotations
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    return allreduce_hook(None, bucket)


def _allreduce(batch_size, steps, accumulate=1, clip_grad_norm=None):
    strategy = paratrain.AllReduceStrategy(device="cpu", shared_memory=False)  # DDP takes one hook: the counter
    counter = _CountAllReduces()
    recipe = {"accumulate": accumulate, "clip_grad_norm": clip_grad_norm}
    params = _train_steps(strategy, batch_size, steps, on_trainer=counter.install, **recipe)
    strategy.teardown()
    return params, counter.calls


def test_allreduce_accumulating_2_batches_of_8_on_2_replicas_equals_single_with_32():
    k = 10
    reference = _single(32, k)
    ranks = run_distributed(_allreduce, 8, k, 2, world_size=2)
    for params, calls in ranks:
        assert relative_difference(params, reference) < TOLERANCE
        # no_sync on the first micro-batch: one all-reduce per step (the mlp's gradient
        # fits one bucket), not one per micro-batch
        assert calls == k
    assert torch.equal(ranks[0][0], ranks[1][0])
    assert relative_difference(_initial(), reference) > 1e-2


def test_allreduce_clips_the_averaged_gradient_as_single_clips_the_global_batch():
    k = 10
    assert _first_gradient_norm(32) > 2 * MAX_NORM
    reference = _single(32, k, clip_grad_norm=MAX_NORM)
    ranks = run_distributed(_allreduce, 16, k, 1, MAX_NORM, world_size=2)
    for params, _ in ranks:
        assert relative_difference(params, reference) < TOLERANCE
    assert torch.equal(ranks[0][0], ranks[1][0])
    # clipping changed the run far beyond the tolerance
    assert relative_difference(_single(32, k), reference) > 100 * TOLERANCE


def _pipeline(batch_size, steps, clip_grad_norm):
    strategy = PipelineStrategy(num_stages=2, num_microbatches=4, schedule="1f1b", device="cpu")
    params = _train_steps(strategy, batch_size, steps, clip_grad_norm=clip_grad_norm)
    stage = strategy.stage
    strategy.teardown()
    return params, stage


def test_pipeline_clips_the_norm_over_both_stages_as_single_does():
    """Both stages' own gradient norms exceed MAX_NORM too (about 1.4 and 3.2), so clipping
    each stage by its own norm would give another result than the replica's global norm."""
    k = 8
    assert _first_gradient_norm(32) > 2 * MAX_NORM
    reference = _single(32, k, clip_grad_norm=MAX_NORM)
    ranks = run_distributed(_pipeline, 32, k, MAX_NORM, world_size=2)
    assert [stage for _, stage in ranks] == [0, 1]
    for params, stage in ranks:
        want = reference[:FIRST_STAGE_SIZE] if stage == 0 else reference[FIRST_STAGE_SIZE:]
        assert relative_difference(params, want) < TOLERANCE
    assert relative_difference(_single(32, k), reference) > 100 * TOLERANCE
