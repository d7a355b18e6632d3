"""tensor's vocabulary-parallel loss (--loss-parallel, parallel/vocabulary.py): the output
layer's logits stay split by vocabulary and the cross-entropy is computed on the slices.
The built-in gpt (its embedding and tied output layer split by vocabulary rows) and a
transformers GPT-2 (its own loss) split 2 ways equal one process of the same global batch,
step by step; each process holds half of the vocabulary's logits; a loss that is no known
cross-entropy, and the option off, get them whole, at the cost of an all-gather."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

import paratrain
from paratrain.models.gpt import GPT
from paratrain.models.gpt_config import GPTConfig
from paratrain.testing import flat_parameters, relative_difference, run_distributed
from paratrain.train.scores import cross_entropy_loss
from tests.conftest import PACKED_TP

pytestmark = pytest.mark.distributed

VOCAB = 64
SEQ = 16
B = 8
STEPS = 4
HEAD = "3.output"  # the gpt of 2 blocks: embeddings, 2 blocks, its head


def gpt():
    torch.manual_seed(0)
    return GPT(VOCAB, SEQ, GPTConfig(gpt_layers=2, gpt_width=32, gpt_heads=4))


def sequences(examples, seed):
    """Sequences counting on from a random token (mod VOCAB), each position's target the next."""
    start = torch.randint(0, VOCAB, (examples, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(SEQ + 1)) % VOCAB
    return ids[:, :-1], ids[:, 1:]


def unmarked_loss(outputs, targets):
    """A loss of the user's own: a cross-entropy, but not marked as one (no loss_parallel)."""
    return cross_entropy_loss(outputs, targets)


def _train(strategy, build=gpt, loss="cross_entropy", head=HEAD, data=None, metrics=("accuracy",)):
    """STEPS batches of SGD (one replica); each step's loss, the whole parameters after them, the
    test loss and metrics, what the output layer ``head`` gave this process in training, and
    the bytes this process counted sent."""
    model = build()
    trainer = paratrain.Trainer(
        model, loss, torch.optim.SGD(model.parameters(), lr=0.1), metrics=metrics, strategy=strategy
    )
    widths, losses = [], []
    layer = dict(trainer.module.named_modules())[head]
    layer.register_forward_hook(lambda m, i, out: widths.append(_width(out)) if m.training else None)
    record = paratrain.Callback()
    record.on_batch_end = lambda step, logs: losses.append(float(logs["local_loss"]))
    train, test = data or (sequences(STEPS * B, 1), sequences(2 * B, 2))
    trainer.fit(train, epochs=1, batch_size=B, seed=0, verbose=0, callbacks=[record])
    tested = trainer.evaluate(test, batch_size=B)
    module = trainer.module
    if isinstance(strategy, paratrain.TensorParallelStrategy):
        params = torch.cat([p.detach().full_tensor().reshape(-1) for p in module.parameters()])
    else:
        params = flat_parameters(module)
    sent = strategy.step_counters()["bytes_sent"]
    strategy.teardown()
    return params, losses, tested, set(widths), sent


def _width(out):
    """What the output layer gave this process: its type and its local shape."""
    return type(out).__name__, tuple(out.to_local().shape if isinstance(out, DTensor) else out.shape)


def _tensor(loss_parallel, loss, build=gpt, head=HEAD, data=None, metrics=("accuracy",)):
    strategy = paratrain.TensorParallelStrategy(2, loss_parallel=loss_parallel, device="cpu")
    return _train(strategy, build, loss, head, data, metrics)


@PACKED_TP
@pytest.mark.parametrize(
    ("loss_parallel", "loss", "split"),
    [(True, "cross_entropy", True), (True, unmarked_loss, False), (False, "cross_entropy", False)],
    ids=["split", "unmarked-loss-gathered", "option-off-gathered"],
)
def test_the_builtin_gpt_with_split_logits_equals_one_process(loss_parallel, loss, split):
    """Each step's loss and the parameters after STEPS SGD steps equal one process's (1e-5),
    and so do the test loss (hence the perplexity) and accuracy, the metric computed on the
    logits made whole. With the cross-entropy the logits each process holds are half the
    vocabulary's (a DTensor): the test fails if they are gathered; a loss not marked as a
    cross-entropy, or the option off, gets them whole, and the bytes sent count the
    all-gather in place of the loss's all-reduces of a few values a position."""
    reference, single_losses, single_tested, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), loss=loss)
    runs = run_distributed(_tensor, loss_parallel, loss, world_size=2)
    for params, losses, tested, widths, sent in runs:
        assert losses == pytest.approx(single_losses, rel=1e-5)
        assert relative_difference(params, reference) < 1e-5
        assert tested["loss"] == pytest.approx(single_tested["loss"], rel=1e-5)
        assert math.exp(tested["loss"]) == pytest.approx(math.exp(single_tested["loss"]), rel=1e-5)
        assert tested["accuracy"] == pytest.approx(single_tested["accuracy"], abs=1e-9)
        assert widths == ({("DTensor", (B, SEQ, VOCAB // 2))} if split else {("Tensor", (B, SEQ, VOCAB))})
        assert sent == pytest.approx(STEPS * (_block_bytes() + _logits_bytes(split)), rel=1e-9)


def _block_bytes():
    """A step's all-reduces of the row-split layers (2 blocks x 2 and the token embedding, each
    (B, SEQ, 32) in float32), forward and as many backward, as a ring of 2 processes sends them."""
    return 2 * (2 * 2 + 1) * B * SEQ * 32 * 4 * (2 * 1 / 2)


def _logits_bytes(split):
    """A step's sends of the output layer: the loss's three all-reduces of one float32 a
    position on split logits, or the whole logits' all-gather (float32), as rings of 2."""
    return B * SEQ * 3 * 4 * (2 * 1 / 2) if split else B * SEQ * VOCAB * 4 * (1 / 2)


@PACKED_TP
def test_a_gpt2_scored_by_its_own_loss_on_split_logits_equals_one_process():
    """transformers' GPT-2 (tied embedding, dict batches, its own loss: ForCausalLMLoss, which
    pads the shifted labels with -100 and calls F.cross_entropy on logits.view(-1, V)) on the
    logits split by vocabulary: each step's loss, the parameters and the test loss equal
    one process's (1e-5); each process's lm_head gives half the vocabulary."""
    pytest.importorskip("transformers")
    from tests.distributed.test_transformers import gpt2, tokens

    data = (tokens(STEPS * B), tokens(2 * B))
    reference, single_losses, single_tested, _, _ = _train(
        paratrain.SingleDeviceStrategy(device="cpu"), gpt2, None, "lm_head", data, ()
    )
    for params, losses, tested, widths, _ in run_distributed(
        _tensor, True, None, gpt2, "lm_head", data, (), world_size=2
    ):
        assert losses == pytest.approx(single_losses, rel=1e-5)
        assert relative_difference(params, reference) < 1e-5
        assert tested["loss"] == pytest.approx(single_tested["loss"], rel=1e-5)
        assert widths == {("DTensor", (B, 16, 32))}  # GPT-2 of the tests: vocabulary 64, 16 positions
