"""DiLoCo's anchors and outer optimizer (strategies/averaging/anchors.py) read back from a
checkpoint or a peer."""

import torch
from torch import nn

from paratrain.strategies.averaging.anchors import Anchors


def _anchors(lr, momentum):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return Anchors(list(model.named_parameters()), 1, lr, momentum, 0), model


def test_a_resumed_run_keeps_its_own_outer_lr_and_momentum_and_the_saved_buffers():
    """Saved under --outer-lr 0.7 --outer-momentum 0.9, read by a run given 0.1 and 0.5: the
    momentum buffers are the saved run's, the learning rate and momentum this run's (torch's
    load_state_dict alone takes the saved ones, and the flags were silently ignored)."""
    saved, model = _anchors(0.7, 0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    saved.outer[0].zero_grad()
    for tensor, delta in zip(saved.tensors, saved.deltas(0)):
        tensor.grad = delta
    saved.outer[0].step()  # momentum buffers made
    resumed, _ = _anchors(0.1, 0.5)
    resumed.load_state_dict(saved.state_dict())
    group = resumed.outer[0].param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.1, 0.5, True)
    buffers = [resumed.outer[0].state[t]["momentum_buffer"] for t in resumed.tensors]
    assert all(torch.equal(a, saved.outer[0].state[t]["momentum_buffer"]) for a, t in zip(buffers, saved.tensors))
