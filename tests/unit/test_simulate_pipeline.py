"""The simulator's pipelines and 3-D meshes (simulate/pipeline.py, pipeline_shape.py): how a
model falls to its stages, and a step's closed form."""

import json

import pytest
import torch
from torch import nn

from paratrain.launch.cli import main
from paratrain.simulate.cluster import Cluster
from paratrain.simulate.pipeline import PipelineMesh, StageShape
from paratrain.simulate.pipeline_shape import stage_starts
from paratrain.simulate.simulator import simulate
from paratrain.simulate.tensor import TensorShape, activation_s
from paratrain.simulate.tensor_shape import measure_stages

B = 8
IN = 16
HIDDEN = 64
OUT = 4


def layers():
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def test_stages_get_their_layers_flops_parameters_and_inputs():
    model = layers()
    starts = stage_starts(model, 2, "2")
    assert starts == ["2"]
    first, second = measure_stages(model, torch.randn(B, IN), starts, None, 1)
    flops = [2 * B * IN * HIDDEN, 2 * B * HIDDEN * HIDDEN + 2 * B * HIDDEN * OUT]
    assert first.compute_share == pytest.approx(flops[0] / sum(flops))
    assert second.compute_share == pytest.approx(flops[1] / sum(flops))
    assert first.shape.whole_bytes == 4 * (IN * HIDDEN + HIDDEN)
    assert second.shape.whole_bytes == 4 * (HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT)
    assert (first.boundary_bytes, second.boundary_bytes) == (0.0, 4 * B * HIDDEN)  # the ReLU's output
    assert first.shape.split_bytes == second.shape.split_bytes == 0.0


def test_stages_start_where_train_cuts_them():
    assert stage_starts(layers(), 2, None) == ["2"]  # balanced by parameters: the 64x64 layer on its own side
    from paratrain.models.gpt import GPT
    from paratrain.models.gpt_config import GPTConfig

    gpt = GPT(64, 16, GPTConfig(gpt_layers=4, gpt_width=32, gpt_heads=4))
    assert stage_starts(gpt, 2, None) == ["3"]  # the blocks shared out: the embeddings and 2 blocks first


class Tied(nn.Module):
    """An embedding and an output layer that share their weight, in different stages."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, IN)
        self.body = nn.Linear(IN, IN)
        self.out = nn.Linear(IN, 32, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.body(self.embed(x)))


def test_a_tied_weight_is_held_by_each_stage_that_uses_it():
    first, second = measure_stages(Tied(), torch.randint(0, 32, (B,)), ["out"], None, 1)
    embed = 4 * 32 * IN
    assert first.shape.whole_bytes == embed + 4 * (IN * IN + IN)
    assert second.shape.whole_bytes == embed
    assert second.boundary_bytes == 4 * B * IN


def test_each_stage_split_by_the_plan_counts_its_own_collectives():
    model = layers()
    plan = {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}
    first, second = measure_stages(model, torch.randn(B, IN), ["2"], plan, 2, loss_parallel=False)
    assert first.shape.split_bytes == 4 * (IN * HIDDEN + HIDDEN)
    assert first.shape.all_reduce_bytes == ()  # its input is the data: no gradient to reduce
    assert second.shape.all_reduce_bytes == (4 * B * HIDDEN, 4 * B * HIDDEN)  # "2" forward, "4" backward
    assert second.shape.all_gather_bytes == (4 * B * OUT,)
    assert (first.shape.modules, second.shape.modules) == (1, 2)
    assert first.shape.split_share == pytest.approx(1.0)  # the ReLU counts no FLOPs


def shape(share=0.0, split=0.0, whole=1e6, reduced=()):
    return TensorShape(size=2, split_bytes=split, whole_bytes=whole, split_share=share, all_reduce_bytes=reduced)


def cluster(workers, **kw):
    return Cluster(workers=workers, compute_s=0.1, model_bytes=2e6, bandwidth=1e9, latency=1e-4, **kw)


def test_step_closed_form_fill_steady_state_drain_then_replicas():
    stages = (StageShape(shape(whole=1e6), 0.4, 0.0), StageShape(shape(whole=3e6), 0.6, 8e5))
    mesh = PipelineMesh(stages, microbatches=4)
    out = simulate("pipeline", cluster(4), 10, mesh=mesh).summary(32)
    send = 2 * (8e5 / 4 / 1e9 + 1e-4)
    u = [0.1 * 0.4 / 4 + send, 0.1 * 0.6 / 4]
    replicas = 2 * 0.5 * 3e6 / 1e9 + 2 * 1e-4  # the fuller stage's ring over 2 replicas
    step = sum(u) + 3 * max(u) + replicas
    assert out["step_seconds"] == pytest.approx(step)
    assert out["examples_per_second"] == pytest.approx(2 * 32 / step)
    assert out["strategy"] == "pipeline S=2"
    assert mesh.held_bytes(4) == 3e6 and mesh.held_bytes(1) == 4e6
    one = simulate("pipeline", cluster(1), 10, mesh=mesh).summary(32)
    assert one["step_seconds"] == pytest.approx(0.1)


def test_a_3d_stage_pays_its_collectives_on_each_micro_batch():
    split = shape(share=0.8, split=4e6, whole=1e6, reduced=(4e5, 4e5))
    mesh = PipelineMesh((StageShape(split, 1.0, 0.0),), tensor=2, microbatches=4, tp_bandwidth=1e10, module_s=1e-3)
    out = simulate("pipeline", cluster(2), 10, mesh=dataclass_replace_modules(mesh, 3)).summary(32)
    per_micro = 0.1 * (0.2 + 0.8 / 2) / 4 + activation_s(split, 2, 1e10, 1e-4, scale=1 / 4) + 3 * 1e-3
    assert activation_s(split, 2, 1e10, 1e-4, scale=1 / 4) == pytest.approx(2 * (2 * 0.5 * 1e5 / 1e10 + 2 * 1e-4))
    assert out["step_seconds"] == pytest.approx(4 * per_micro)
    assert out["strategy"] == "pipeline S=1 x T=2"


def dataclass_replace_modules(mesh, modules):
    import dataclasses

    stage = mesh.stages[0]
    return dataclasses.replace(
        mesh, stages=(dataclasses.replace(stage, shape=dataclasses.replace(stage.shape, modules=modules)),)
    )


def test_workers_must_fill_whole_replicas():
    from paratrain.errors import ConfigError

    mesh = PipelineMesh((StageShape(shape(), 0.5, 0.0), StageShape(shape(), 0.5, 1e3)), tensor=2)
    with pytest.raises(ConfigError, match="--workers 6 is not a multiple of --stages x --tensor-parallel"):
        simulate("pipeline", cluster(6), 10, mesh=mesh)


def test_cli_compares_pipelines_and_a_3d_mesh_of_the_gpt(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["simulate", "--model", "gpt", "--dataset", "text-lm", "--compute-ms", "50", "--steps", "20"]
    args += ["--strategy", "allreduce,pipeline", "--stages", "2", "--tensor-parallel", "1,2", "--workers", "2,4"]
    args += ["--batch-size", "16", "--json-out", str(out)]
    assert main(args) == 0
    assert "gpt in 2 stages of 2 processes" in capsys.readouterr().out
    rows = {(r["strategy"], r["workers"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {
        ("allreduce", 2),
        ("allreduce", 4),
        ("pipeline S=2", 2),
        ("pipeline S=2", 4),
        ("pipeline S=2 x T=2", 4),
    }
    held = {key: r["parameter_bytes_per_process"] for key, r in rows.items() if key[0] != "allreduce"}
    assert held[("pipeline S=2 x T=2", 4)] < held[("pipeline S=2", 4)] == held[("pipeline S=2", 2)]
    # 2 replicas of a 2-stage pipeline make twice the examples of one at nearly the same step
    ratio = rows[("pipeline S=2", 4)]["examples_per_second"] / rows[("pipeline S=2", 2)]["examples_per_second"]
    assert 1.8 < ratio <= 2.0


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--stages", "2"], "add pipeline to --strategy"),
        (["--strategy", "pipeline", "--shard-replicas"], "add tensor to --strategy"),
        (["--strategy", "pipeline", "--stages", "0"], "--stages must be counts >= 1"),
        (["--strategy", "pipeline", "--workers", "3"], "none is a multiple of the processes a replica takes"),
        (["--strategy", "pipeline", "--microbatches", "3"], "--batch-size 32 must be a multiple of --microbatches 3"),
        (["--strategy", "pipeline", "--split-points", "nowhere"], "has no module 'nowhere'"),
        (["--strategy", "pipeline", "--workers", "4", "--target-accuracy", "0.5"], "--train, --target-"),
    ],
)
def test_cli_refuses_pipeline_flags_it_cannot_use(extra, words, capsys):
    args = ["simulate", "--model", "gpt", "--dataset", "text-lm", "--compute-ms", "50", "--steps", "5", *extra]
    assert main(args) == 2
    assert words in capsys.readouterr().err


def test_a_gpt2_from_transformers_falls_to_its_stages_by_blocks():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    starts = stage_starts(model, 2, None)
    assert starts == ["transformer.h.2"]
    inputs = {"input_ids": torch.randint(0, 64, (2, 16))}
    first, second = measure_stages(model, inputs, starts, None, 1)
    assert first.compute_share + second.compute_share == pytest.approx(1.0)
    assert 0.4 < first.compute_share < 0.6
    assert second.boundary_bytes == 4 * 2 * 16 * 32  # the hidden states
    tied = model.transformer.wte.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert first.shape.whole_bytes + second.shape.whole_bytes == total + tied  # the tied weight in both
    split = measure_stages(model, inputs, starts, None, 2, loss_parallel=False)
    assert split[1].shape.all_gather_bytes == (4 * 2 * 16 * 64,)  # the logits gathered in the last stage
    assert split[0].shape.all_gather_bytes == ()
