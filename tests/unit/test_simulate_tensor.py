"""The simulator's tensor parallelism (simulate/tensor.py, tensor_shape.py): what it measures
of a model and a plan, and a step's closed form on a mesh."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.launch.cli import main
from paratrain.simulate.cluster import Cluster
from paratrain.simulate.simulator import simulate
from paratrain.simulate.tensor import Mesh, TensorShape, activation_s, compute_scale
from paratrain.simulate.tensor_shape import measure

B = 8
IN = 16
HIDDEN = 64
OUT = 4
PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class Net(nn.Module):
    """fc1 and fc2 split by the plan, head left whole."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, IN)
        self.head = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(x))))


def test_measure_counts_the_split_parameters_flops_and_collectives():
    shape = measure(Net(), torch.randn(B, IN), PLAN, 2)
    assert shape.split_bytes == 4 * (IN * HIDDEN + HIDDEN + HIDDEN * IN + IN)
    assert shape.whole_bytes == 4 * (IN * OUT + OUT)
    linear_flops = 2 * B * (IN * HIDDEN + HIDDEN * IN)  # the split matrix products
    assert shape.split_share == pytest.approx(linear_flops / (linear_flops + 2 * B * IN * OUT))
    # fc2's output all-reduced forward; fc1's input needs no gradient (the data): nothing backward
    assert shape.all_reduce_bytes == (4 * B * IN,)
    assert shape.all_gather_bytes == ()
    inputs, plan = torch.randn(B, IN, requires_grad=True), {**PLAN, "head": "colwise_rep"}
    shape = measure(Net(), inputs, plan, 2, loss_parallel=False)
    assert shape.all_reduce_bytes == (4 * B * IN,) * 3  # fc1 and head backward, fc2 forward
    assert shape.all_gather_bytes == (4 * B * OUT,)  # the logits gathered whole
    shape = measure(Net(), inputs, plan, 2)  # the loss on the slices: 3 all-reduces of a value an example
    assert sorted(shape.all_reduce_bytes) == [4 * B] * 3 + [4 * B * IN] * 3
    assert shape.all_gather_bytes == ()


def test_measure_refuses_what_train_refuses():
    with pytest.raises(ConfigError, match="not a multiple of 3"):
        measure(Net(), torch.randn(B, IN), PLAN, 3)


def test_gpt2_block_costs_megatrons_two_all_reduces_each_way():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    inputs = {"input_ids": torch.randint(0, 64, (2, 16))}
    shape = measure(model, inputs, None, 2, loss_parallel=False)
    hidden = 4 * 2 * 16 * 32
    # per block: attention and MLP outputs forward, c_attn and c_fc inputs backward; the
    # embedding's vocabulary-split output forward; the output layer's input backward
    assert sorted(shape.all_reduce_bytes) == [hidden] * (4 * 2 + 2)
    assert shape.all_gather_bytes == (4 * 2 * 16 * 64,)  # the logits gathered whole
    assert 0.8 < shape.split_share <= 1.0
    split = measure(model, inputs, None, 2)  # the loss on the slices: 3 values a position, no gather
    assert sorted(split.all_reduce_bytes) == [4 * 2 * 16] * 3 + [hidden] * (4 * 2 + 2)
    assert split.all_gather_bytes == ()


SHAPE = TensorShape(
    size=2, split_bytes=8e6, whole_bytes=1e6, split_share=0.9, all_reduce_bytes=(2e6, 2e6), all_gather_bytes=(1e6,)
)


def cluster(workers, **kw):
    return Cluster(workers=workers, compute_s=0.1, model_bytes=9e6, bandwidth=1e9, latency=1e-4, **kw)


def test_step_closed_form_on_a_two_by_two_mesh():
    mesh = Mesh(SHAPE, 2, tp_bandwidth=1e10)
    out = simulate("tensor", cluster(4), 10, mesh=mesh).summary(32)
    compute = 0.1 * (0.1 + 0.9 / 2)
    activations = 2 * (2 * 0.5 * 2e6 / 1e10 + 2 * 1e-4) + (0.5 * 1e6 / 1e10 + 1e-4)
    part = 8e6 / 2 + 1e6
    replicas = 2 * 0.5 * part / 1e9 + 2 * 1e-4  # a ring of the 2 replicas
    assert compute_scale(SHAPE, 2) == pytest.approx(0.55)
    assert activation_s(SHAPE, 2, 1e10, 1e-4) == pytest.approx(activations)
    assert out["step_seconds"] == pytest.approx(compute + activations + replicas)
    assert out["examples_per_second"] == pytest.approx(2 * 32 / (compute + activations + replicas))
    assert out["strategy"] == "tensor T=2"


def test_the_replica_s_own_ring_step_prices_its_collectives():
    slow = simulate("tensor", cluster(2, ring_latency=5e-3), 10, mesh=Mesh(SHAPE, 2)).summary(32)
    own = simulate("tensor", cluster(2, ring_latency=5e-3), 10, mesh=Mesh(SHAPE, 2, tp_latency=1e-5)).summary(32)
    # 3 collectives of 2 ring steps (all-gather: 1) at 5 ms against 10 us
    assert slow["step_seconds"] - own["step_seconds"] == pytest.approx((2 + 2 + 1) * (5e-3 - 1e-5))


def test_each_split_module_adds_its_calibrated_cost_on_a_split_mesh_only():
    base = simulate("tensor", cluster(4), 10, mesh=Mesh(SHAPE, 2)).summary(32)
    costly = simulate("tensor", cluster(4), 10, mesh=Mesh(dataclasses.replace(SHAPE, modules=6), 2, module_s=1e-3))
    assert costly.summary(32)["step_seconds"] == pytest.approx(base["step_seconds"] + 6e-3)
    whole = simulate("tensor", cluster(4), 10, mesh=Mesh(SHAPE, 1, module_s=1e-3)).summary(32)
    assert whole["step_seconds"] == pytest.approx(simulate("allreduce", cluster(4), 10).summary(32)["step_seconds"])


def test_the_gpt_s_norms_are_no_split_modules():
    from paratrain.models.gpt import GPT
    from paratrain.models.gpt_config import GPTConfig

    model = GPT(64, 16, GPTConfig(gpt_layers=2, gpt_width=32, gpt_heads=4))
    shape = measure(model, torch.randint(0, 64, (2, 16)), None, 2)
    norms = sum(p.numel() * 4 for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    position = model[0].position.weight.numel() * 4
    assert shape.whole_bytes == norms + position  # everything else is split: the blocks, the tied vocabulary
    assert shape.modules == 2 * 4 + 2  # 4 a block, the token embedding and the output layer


def test_one_way_mesh_is_allreduce_and_its_sharded_replicas_fsdp():
    plain = simulate("tensor", cluster(4), 10, mesh=Mesh(SHAPE, 1)).summary(32)
    assert plain["step_seconds"] == pytest.approx(simulate("allreduce", cluster(4), 10).summary(32)["step_seconds"])
    sharded = simulate("tensor", cluster(4), 10, mesh=Mesh(SHAPE, 1, shard_replicas=True)).summary(32)
    assert sharded["step_seconds"] == pytest.approx(simulate("fsdp", cluster(4), 10).summary(32)["step_seconds"])


def test_enough_cores_agree_with_the_rounds():
    mesh = Mesh(SHAPE, 2)
    rounds = simulate("tensor", cluster(4), 20, mesh=mesh).summary(32)
    host = simulate("tensor", cluster(4, host_cores=64), 20, mesh=mesh).summary(32)
    assert host["step_seconds"] == pytest.approx(rounds["step_seconds"], rel=1e-9)
    assert host["examples_per_second"] == pytest.approx(rounds["examples_per_second"], rel=1e-9)


def test_workers_must_fill_whole_replicas():
    with pytest.raises(ConfigError, match="--workers 3 is not a multiple of --tensor-parallel 2"):
        simulate("tensor", cluster(3), 10, mesh=Mesh(SHAPE, 2))


def test_cli_compares_meshes_of_the_gpt(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["simulate", "--model", "gpt", "--dataset", "text-lm", "--compute-ms", "50", "--steps", "20"]
    args += ["--strategy", "allreduce,tensor", "--tensor-parallel", "2,4", "--workers", "2,4"]
    args += ["--tp-bandwidth-gbps", "100", "--json-out", str(out)]
    assert main(args) == 0
    assert "tensor plan of gpt" in capsys.readouterr().out
    rows = {(r["strategy"], r["workers"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("allreduce", 2), ("allreduce", 4), ("tensor T=2", 2), ("tensor T=2", 4), ("tensor T=4", 4)}
    held = {key: r["parameter_bytes_per_process"] for key, r in rows.items() if key[0] != "allreduce"}
    assert held[("tensor T=4", 4)] < held[("tensor T=2", 4)] == held[("tensor T=2", 2)]
    assert rows[("tensor T=2", 2)]["step_seconds"] < 0.05  # each process computes about half


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tensor-parallel", "4"], "add tensor or pipeline to --strategy"),
        (["--no-loss-parallel"], "add tensor to --strategy"),
        (["--strategy", "tensor", "--model-mb", "10"], "--model-mb gives neither"),
        (["--strategy", "tensor", "--tensor-parallel", "0"], "--tensor-parallel must be counts >= 1"),
        (["--strategy", "tensor", "--workers", "3"], "none is a multiple of the processes a replica takes"),
        (["--strategy", "tensor", "--workers", "4", "--train"], "--train, --target-"),
    ],
)
def test_cli_refuses_tensor_flags_it_cannot_use(extra, words, capsys):
    args = ["simulate", "--model", "gpt", "--dataset", "text-lm", "--compute-ms", "50", "--steps", "5", *extra]
    assert main(args) == 2
    assert words in capsys.readouterr().err
