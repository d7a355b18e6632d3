"""comm/flat.py: gradients as one flat buffer, and their mean over a group in one all-reduce."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import flat_gradients, mean_gradients, write_gradients
from paratrain.comm.transport import ensure_process_group
from paratrain.testing import run_distributed


def test_a_missing_gradient_is_zeros_and_writing_back_makes_it():
    a, b = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(4))
    a.grad = torch.arange(6.0).view(2, 3)
    flat = flat_gradients([a, b])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    write_gradients([a, b], torch.arange(10.0) * 2)
    assert a.grad.tolist() == [[0, 2, 4], [6, 8, 10]] and b.grad.tolist() == [12, 14, 16, 18]


def _mean_of_ranks():
    rank = ensure_process_group("gloo", 30.0).rank
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    sent = mean_gradients(params, None, dist.get_world_size())
    grads = [p.grad.tolist() for p in params]
    dist.destroy_process_group()
    return sent, grads


@pytest.mark.slow
def test_the_mean_over_processes_is_each_gradient_s_mean():
    (sent, grads), (_, other) = run_distributed(_mean_of_ranks, world_size=2)
    assert sent == 7 * 4 and grads == other == [[1.5] * 3, [[1.5, 1.5], [1.5, 1.5]]]
