"""PyTorch's PowerSGD hook with error feedback after a gradient that is not finite (an fp16
overflow, whose step the scaler skips): its residual and warm-start Q would hold NaN from
then on, and every later gradient decode to NaN. A one-process Gloo group trains a small
model under DDP with the hook; one compressed step's gradient holds an Inf."""

import gc
import math

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.codec_config import make_codec
from paratrain.comm.hooks import make_hook


def _steps() -> list[bool]:
    """Whether each step's reduced gradient was finite: two plain steps, a compressed one,
    one whose gradient holds an Inf (skipped), then three more."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)))
    hook = make_hook(make_codec("powersgd"))  # with error feedback, as --compression powersgd
    hook.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    finite = []
    for step in range(7):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (loss * (math.inf if step == 3 else 1.0)).backward()
        ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        finite.append(ok)
        if ok:
            optimizer.step()
    return finite


def test_a_step_that_overflows_is_skipped_and_the_next_ones_are_finite():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        finite = _steps()
        gc.collect()  # DDP's reducer holds the group: freed before the group is destroyed
    finally:
        dist.destroy_process_group()
    assert finite == [True, True, True, False, True, True, True]
