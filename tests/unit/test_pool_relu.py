"""A ReLU followed by a max-pooling pools first (strategies/pool_relu.py): the same step,
bit for bit, on a user's nn.Sequential; pairs with hooks, other containers and
``pool_before_relu=False`` are left as written."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.config import TrainConfig
from paratrain.strategies.pool_relu import pool_before_relu


def conv_net(shared_relu: nn.ReLU | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    relu = shared_relu or nn.ReLU()
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        relu,
        nn.MaxPool2d(3, 2, padding=1),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 16),
        relu,
        nn.Linear(16, 4),
    )


def test_each_relu_then_pool_pair_is_swapped_in_place_and_the_relu_runs_in_place():
    shared = nn.ReLU()
    model = conv_net(shared)
    assert pool_before_relu(model) == ["2", "3.2"]
    assert [type(m).__name__ for m in model[:3]] == ["Conv2d", "MaxPool2d", "ReLU"]
    assert [type(m).__name__ for m in model[3]] == ["Conv2d", "MaxPool2d", "ReLU"]
    assert model[2].inplace and model[3][2].inplace
    assert model[6] is shared and not shared.inplace  # the ReLU used elsewhere keeps its own setting
    assert pool_before_relu(model) == []  # nothing left to move
    assert sorted(model.state_dict()) == sorted(conv_net().state_dict())  # the parameters keep their names


def test_a_pair_with_a_hook_stays_as_written():
    model = conv_net()
    model[1].register_forward_hook(lambda module, inputs, output: None)
    assert pool_before_relu(model) == ["3.2"]
    assert isinstance(model[1], nn.ReLU)


def _train(model: nn.Module, steps: int = 6) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 3, 16, 16, generator=generator)
        x[:4] = -x[:4].abs()  # whole windows below zero: the ReLU's zero derivative both ways
        x[4:6] = 0.0  # ties
        y = torch.randint(0, 4, (16,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_the_rewritten_model_trains_bit_for_bit_as_the_model_as_written():
    written, rewritten = conv_net(), conv_net()
    assert pool_before_relu(rewritten)
    losses, params = _train(written)
    losses_rewritten, params_rewritten = _train(rewritten)
    assert losses == losses_rewritten
    assert all(torch.equal(a, b) for a, b in zip(params, params_rewritten))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_trainer_rewrites_unless_told_not_to(enabled):
    model = conv_net()
    trainer = paratrain.Trainer(
        model,
        "cross_entropy",
        torch.optim.SGD(model.parameters(), lr=0.1),
        metrics=(),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
        cpu=paratrain.CpuTuning(pool_before_relu=enabled),
    )
    assert isinstance(trainer.module[1], nn.MaxPool2d if enabled else nn.ReLU)
    data = TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 4, (64,)))
    assert len(trainer.fit(data, epochs=1, batch_size=16, verbose=0).epochs) == 1


def test_the_command_line_flag_turns_it_off():
    assert TrainConfig().pool_before_relu is True
    assert TrainConfig(pool_before_relu=False).pool_before_relu is False
