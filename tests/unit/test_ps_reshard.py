"""A parameter-server checkpoint read by another number of shards: the shards' slices of
the parameters and of every optimizer state cut again at the new bounds. The update
rules are elementwise, so training on from a resharded state is the unsharded run to the
bit."""

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.strategies.ps.protocol.server import ShardServer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _optimizer(kind, model):
    first, second = list(model[0].parameters()), list(model[2].parameters())
    groups = [{"params": first}, {"params": second, "lr": 0.05}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01, betas=(0.8, 0.9))
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)


def _servers(kind, shards):
    model = _model()
    optimizer = _optimizer(kind, model)
    options = {"rule": None, "store": None, "heartbeat_timeout": 1.0, "tolerate_loss": False, "wait_timeout": 1.0}
    return [ShardServer(s, shards, 2, model, optimizer, **options) for s in range(shards)]


def _train(servers, steps, first):
    """``steps`` updates with the same full gradients whatever the shards."""
    for step in range(first, first + steps):
        full = torch.sin(torch.arange(servers[0].layout.total, dtype=torch.float32) * (step + 1))
        for server in servers:
            server.grad.copy_(full[server.layout.shard_range(server.shard)])
            server.optimizer.step()
            server.version += 1


def _flat(servers):
    return torch.cat([server.params for server in servers])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize(("saved", "read"), [(1, 3), (3, 2), (2, 1), (4, 4)])
def test_training_goes_on_from_another_number_of_shards_to_the_bit(kind, saved, read):
    reference = _servers(kind, 1)
    _train(reference, 6, first=0)
    before = _servers(kind, saved)
    _train(before, 3, first=0)
    for server in before:
        server.batch_dealer.next_batch, server.batch_dealer.num_batches = {0: 5 + server.shard}, {0: 14}
    states = [server.state_dict() for server in before]
    after = _servers(kind, read)
    for server in after:
        server.load_resharded(states)
    assert torch.equal(_flat(after), _flat(before))
    assert [s.version for s in after] == [3] * read
    assert after[0].batch_dealer.next_batch == {0: 5} and after[-1].batch_dealer.next_batch == {
        0: 5 + min(read, saved) - 1
    }
    for server in after:  # hyper-parameters per group kept (the second group's own lr)
        assert {g["lr"] for g in server.optimizer.param_groups} <= {0.1, 0.01, 0.05}
    _train(after, 3, first=3)
    assert torch.equal(_flat(after), _flat(reference))


def test_a_group_hyper_parameter_changed_before_saving_is_kept():
    before = _servers("sgd", 2)
    _train(before, 2, first=0)
    for server in before:
        for group in server.optimizer.param_groups:
            group["lr"] *= 0.5
    after = _servers("sgd", 3)
    for server in after:
        server.load_resharded([server.state_dict() for server in before])
    lrs = {round(g["lr"], 6) for server in after for g in server.optimizer.param_groups}
    assert lrs == {0.05, 0.025}


def test_shards_of_different_versions_or_another_model_are_refused():
    before = _servers("sgd", 2)
    states = [server.state_dict() for server in before]
    states[1]["version"] = 4
    with pytest.raises(ConfigError, match=r"different versions \[0, 4\]"):
        _servers("sgd", 3)[0].load_resharded(states)
    states = [before[0].state_dict()]
    with pytest.raises(ConfigError, match="shards hold 33 parameters, this model has 66"):
        _servers("sgd", 3)[0].load_resharded(states)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_a_shard_rebuilds_the_users_optimizer_with_its_settings(kind):
    """AdamW keeps a default its constructor does not take (Adam's decoupled_weight_decay):
    the shard's copy is built all the same, with the user's hyper-parameters per group."""
    model = _model()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.05}]
    optimizer = {
        "adamw": lambda: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, betas=(0.8, 0.95)),
        "adam": lambda: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
        "sgd": lambda: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    }[kind]()
    options = {"rule": None, "store": None, "heartbeat_timeout": 1.0, "tolerate_loss": False, "wait_timeout": 1.0}
    server = ShardServer(0, 1, 2, model, optimizer, **options)
    assert type(server.optimizer) is type(optimizer)
    for mine, theirs in zip(server.optimizer.param_groups, optimizer.param_groups, strict=True):
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}
