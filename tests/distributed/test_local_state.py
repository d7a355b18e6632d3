"""A module and optimizer split by tensor parallelism whose state dicts hold each process's
own part (parallel/local_state.py, what a 3-D pipeline's checkpoint part holds): plain
tensors out, the same split DTensors back in, the optimizer's moments with them."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.testing import run_distributed

pytestmark = pytest.mark.distributed


def _split_pair():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _round_trip():
    from paratrain.parallel.local_state import hold_local_parts

    dist.init_process_group("gloo")
    try:
        model, optimizer = _split_pair()
        hold_local_parts(model, optimizer)
        _step(model, optimizer, 1)
        # through a file's bytes, read with weights_only, as a checkpoint part is
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        saved_model, saved_optimizer = saved["model"], saved["optimizer"]
        plain = all(type(v) is torch.Tensor for v in saved_model.values())
        moments = [s["exp_avg"] for s in saved_optimizer["state"].values()]
        plain = plain and all(type(m) is torch.Tensor for m in moments)
        shapes = {k: tuple(v.shape) for k, v in saved_model.items()}
        # a fresh split pair takes the parts back, and steps on as the first one does
        other, other_optimizer = _split_pair()
        hold_local_parts(other, other_optimizer)
        other.load_state_dict(saved_model)
        other_optimizer.load_state_dict(saved_optimizer)
        _step(model, optimizer, 2)
        _step(other, other_optimizer, 2)
        same = all(
            torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), other.parameters())
        )
        return {"plain": plain, "shapes": shapes, "same": same}
    finally:
        dist.destroy_process_group()


def test_parts_go_out_plain_and_come_back_split_with_the_optimizer_state():
    first, second = run_distributed(_round_trip, world_size=2)
    assert first["plain"] and second["plain"]
    # this process's half of the column-wise weight and bias, and of the row-wise weight
    assert first["shapes"] == {"0.weight": (8, 8), "0.bias": (8,), "2.weight": (4, 8), "2.bias": (4,)}
    assert first["same"] and second["same"]  # the step after the load equals the step never saved
