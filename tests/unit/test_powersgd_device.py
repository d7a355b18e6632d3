"""PyTorch's PowerSGD hook on a model in host memory, in a process that sees a GPU.

The hook synchronises its bucket's device whenever ``torch.cuda.is_available()``, also for a
bucket in host memory, where ``torch.cuda.synchronize`` raises: on a GPU machine,
``--compression powersgd --device cpu`` failed at its first compressed step.
``paratrain.comm.hooks`` gives the hook a ``torch.cuda`` that synchronises CUDA devices only.
Here CUDA is made to look available (this machine has none) and a one-process Gloo group
trains a small model under DDP with the hook past its plain warm-up steps.
"""

import gc

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.codec_config import make_codec
from paratrain.comm.hooks import make_hook


def _train(hook_state: dict) -> None:
    """Four steps under DDP with the hook; everything holding the group is freed on return."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)))
    hook = make_hook(make_codec("powersgd"))
    hook.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    for _ in range(4):  # two plain all-reduces, then two compressed steps
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    hook_state.update(iter=hook.state.iter, compressed_at=hook.compressed_at)


def test_powersgd_compresses_a_cpu_model_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state: dict = {}
    try:
        _train(state)
        gc.collect()  # DDP's reducer holds the group: freed before the group is destroyed, not after
    finally:
        dist.destroy_process_group()
    assert state["iter"] == 4
    assert state["compressed_at"]  # the hook compressed a bucket (and synchronised nothing)
