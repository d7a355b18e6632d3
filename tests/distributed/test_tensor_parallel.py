"""tensor: each layer split over the processes of a replica (DTensor), against the
single-process reference on the same global batch: a transformers GPT-2 (tied embedding,
fused query-key-value, dict batches and its own loss), a Llama that carries its own plan,
and paratrain's gpt from the command line, split 2 ways and on a 2 x 2 mesh."""

import json

import pytest
import torch

import paratrain
from paratrain.testing import flat_parameters, relative_difference, run_distributed
from tests.conftest import PACKED_TP, SEQUENCE_PACKED_TP
from tests.distributed.test_transformers import PROJECT, SEQ, STEPS, B, gpt2, optimizer_for, tokens

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")


def llama(tied=True):
    """A Llama whose config carries its tensor-parallel plan (base_model_tp_plan), with
    grouped-query attention (4 query heads, 2 key-value heads) and a tied output layer
    (or, ``tied`` False, an output layer of its own)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def untied_llama():
    """Its embedding split by vocabulary rows: transformers 5.24's own plan says so
    (``embedding_rowwise``), 5.17's leaves it whole, so it is named here too."""
    model = llama(tied=False)
    model._tp_plan = {**model._tp_plan, "model.embed_tokens": "embedding_rowwise"}
    return model


def _train(strategy, batch_size, optimizer="sgd", build=gpt2, clip=None, accumulate=1, precision="fp32"):
    """One epoch of STEPS global batches; the whole parameters (gathered from the splits),
    each step's loss, and what each split parameter holds here against its whole size."""
    model = build()
    opt = optimizer_for(model, optimizer)
    trainer = paratrain.Trainer(
        model,
        optimizer=opt,
        strategy=strategy,
        metrics=(),
        clip_grad_norm=clip,
        accumulate=accumulate,
        precision=precision,
    )
    losses = []
    record = paratrain.Callback()
    record.on_batch_end = lambda step, logs: losses.append(float(logs["local_loss"]))
    examples = STEPS * batch_size * accumulate * strategy.num_replicas
    trainer.fit(tokens(examples), epochs=1, batch_size=batch_size, seed=0, verbose=0, callbacks=[record])
    module = trainer.module
    if isinstance(strategy, paratrain.TensorParallelStrategy):
        params = torch.cat([p.detach().full_tensor().reshape(-1) for p in module.parameters()])
        held = {n: (p.to_local().numel(), p.numel()) for n, p in module.named_parameters()}
    else:
        params, held = flat_parameters(module), {}
    strategy.teardown()
    return params, losses, held


def _tensor(replicas, tensor, optimizer, build, clip=None, accumulate=1, precision="fp32", shard=False):
    strategy = paratrain.TensorParallelStrategy(tensor, shard_replicas=shard, device="cpu")
    return _train(strategy, B // accumulate, optimizer, build, clip, accumulate, precision)


@PACKED_TP
def test_replicas_sharded_by_fsdp_train_as_the_mesh_of_whole_replicas():
    """A 2 x 2 mesh whose replicas shard their parts by FSDP2 (2-D): every step's loss on each
    replica equals that of the mesh whose replicas all-reduce (itself one process's run, the
    test above), to the rounding of the sums; each process holds 1/4 of each split weight
    and 1/2 of the others."""
    plain = run_distributed(_tensor, 2, 2, "sgd", gpt2, world_size=4)
    sharded = run_distributed(_tensor, 2, 2, "sgd", gpt2, None, 1, "fp32", True, world_size=4)
    for (_, losses, _), (_, expected, _) in zip(sharded, plain):
        assert losses == pytest.approx(expected, rel=1e-5)
    held = sharded[0][2]
    assert held["transformer.h.0.mlp.c_fc.weight"] == (32 * 128 // 4, 32 * 128)
    assert held["transformer.h.0.ln_1.weight"] == (32 // 2, 32)


@PACKED_TP
def test_accumulated_micro_batches_make_the_step_of_the_whole_batch():
    """--accumulate 2 on half batches: the gradient of the whole batch, so one process's
    parameters with the whole batch (1e-5)."""
    reference, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B)
    for params, _, _ in run_distributed(_tensor, 1, 2, "sgd", gpt2, None, 2, world_size=2):
        assert relative_difference(params, reference) < 1e-5


@PACKED_TP
def test_bf16_trains_as_one_process_in_bf16_does():
    """Under bf16 autocast the split matmuls round differently from the whole ones (bf16 keeps
    8 bits: 3.9e-3 relative per product, averaged over the sums of a loss); each step's loss
    stays within 1e-3 of one process's in bf16 (4e-5 measured)."""
    _, single_losses, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B, precision="bf16")
    for _, losses, _ in run_distributed(_tensor, 1, 2, "sgd", gpt2, None, 1, "bf16", world_size=2):
        assert losses == pytest.approx(single_losses, rel=1e-3)


@PACKED_TP
def test_clipping_takes_the_norm_over_every_split_as_one_process_does():
    """A clip norm below the gradient's (0.5; GPT-2's first gradients are near 3) scales every
    step: the norm must be the whole gradient's, each split counted once and the tied
    embedding once, for the parameters to equal one process's."""
    reference, _, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B, clip=0.5)
    for params, _, _ in run_distributed(_tensor, 1, 2, "sgd", gpt2, 0.5, world_size=2):
        assert relative_difference(params, reference) < 1e-5


@PACKED_TP
@pytest.mark.parametrize(("replicas", "tensor"), [(1, 2), (2, 2)], ids=["2-way", "2x2-mesh"])
def test_a_gpt2_split_by_tensor_parallelism_equals_one_process(replicas, tensor):
    """The final parameters (and with one replica every step's loss) equal one process of the global batch
    (SGD: the same sums in another order, 1e-5); each process holds 1/T of each split
    weight (the fused query-key-value, the MLP, the tied embedding and output layer), and
    the norms and position embedding whole."""
    reference, single_losses, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B * replicas, build=gpt2)
    for params, losses, held in run_distributed(_tensor, replicas, tensor, "sgd", gpt2, world_size=replicas * tensor):
        assert relative_difference(params, reference) < 1e-5
        if replicas == 1:  # each step's loss is the replica's: that of the whole batch
            assert losses == pytest.approx(single_losses, rel=1e-5)
        split = [n for n, (here, whole) in held.items() if here * tensor == whole]
        assert set(split) == {
            "transformer.wte.weight",
            *(
                f"transformer.h.{i}.{m}"
                for i in range(2)
                for m in (
                    "attn.c_attn.weight",
                    "attn.c_attn.bias",
                    "attn.c_proj.weight",
                    "mlp.c_fc.weight",
                    "mlp.c_fc.bias",
                    "mlp.c_proj.weight",
                )
            ),
        }
        assert all(here == whole for n, (here, whole) in held.items() if n not in split)


def _frozen_position_embedding_moved(replicas, tensor):
    """Whether a GPT-2's frozen position embedding moved under AdamW (weight decay 0.01)
    over STEPS steps on ``replicas`` x ``tensor`` processes."""
    model = gpt2()
    model.transformer.wpe.weight.requires_grad_(False)  # frozen, as in a fine-tuning
    before = model.transformer.wpe.weight.detach().clone()
    strategy = paratrain.TensorParallelStrategy(tensor, device="cpu")
    trainer = paratrain.Trainer(model, optimizer=optimizer_for(model, "adamw"), strategy=strategy, metrics=())
    trainer.fit(tokens(STEPS * B * replicas), epochs=1, batch_size=B, seed=0, verbose=0)
    after = trainer.module.transformer.wpe.weight
    after = after.full_tensor() if hasattr(after, "full_tensor") else after
    strategy.teardown()
    return not torch.equal(after.detach(), before)


@PACKED_TP
def test_a_frozen_parameter_stays_as_it_was_on_a_mesh():
    """A 2 x 2 mesh averages the gradients over its replicas: a frozen parameter is left out,
    as every other strategy leaves it (given a zero gradient, AdamW's weight decay moved it)."""
    assert run_distributed(_frozen_position_embedding_moved, 2, 2, world_size=4) == [False] * 4


def test_a_llama_split_by_its_own_plan_trains_with_adamw_as_one_process():
    """The plan comes from the model (transformers' _tp_plan, from its config's
    base_model_tp_plan); the tied embedding and output layer are split by vocabulary rows
    alike and stay one parameter. AdamW: each step's loss to 1e-4 (where a gradient is rounding noise, AdamW's
    division by its root makes the noise a whole step, so the parameters are not compared)."""
    _, single_losses, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B, "adamw", build=llama)
    for _, losses, held in run_distributed(_tensor, 1, 2, "adamw", llama, world_size=2):
        assert losses == pytest.approx(single_losses, rel=1e-4)
        assert held["model.layers.0.self_attn.q_proj.weight"] == (32 * 32 // 2, 32 * 32)
        assert held["model.layers.1.mlp.down_proj.weight"] == (64 * 32 // 2, 64 * 32)
        assert held["model.embed_tokens.weight"] == (64 * 32 // 2, 64 * 32)
        assert held["model.norm.weight"] == (32, 32)


def test_an_untied_llama_s_embedding_split_by_vocabulary_gets_the_gradient_of_one_process():
    """With its own output layer, the embedding split by vocabulary rows takes its gradient
    alone (no tied sum): SGD's parameters after every step equal one process's (1e-5), each
    process holding half of the embedding's rows and of the output layer's."""
    reference, single_losses, _ = _train(paratrain.SingleDeviceStrategy(device="cpu"), B, build=untied_llama)
    for params, losses, held in run_distributed(_tensor, 1, 2, "sgd", untied_llama, world_size=2):
        assert relative_difference(params, reference) < 1e-5
        assert losses == pytest.approx(single_losses, rel=1e-5)
        assert held["model.embed_tokens.weight"] == (64 * 32 // 2, 64 * 32)
        assert held["lm_head.weight"] == (64 * 32 // 2, 64 * 32)


@SEQUENCE_PACKED_TP
def test_the_builtin_gpt_on_a_mesh_equals_allreduce_from_the_command_line(cli, tmp_path):
    """--workers 4 --tensor-parallel 2: two replicas of two processes, the global batch of
    allreduce --workers 2 (2 x 16): the same test loss to the rounding of the sums; with
    --sequence-parallel too."""
    text = tmp_path / "text.txt"  # 12 global batches of 32 examples of 32 bytes, and a test tenth
    text.write_bytes(bytes((7 * i + i // 97) % 251 for i in range(32 * 32 * 12 * 10 // 9 + 64)))
    common = [
        "train",
        "--model",
        "gpt",
        "--dataset",
        f"text-lm:{text}",
        "--seq-len",
        "32",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--gpt-layers",
        "2",
        "--gpt-width",
        "32",
        "--gpt-heads",
        "4",
        "--no-progress",
    ]
    results = {}
    for name, extra in {
        "allreduce": ["--workers", "2"],
        "tensor": ["--workers", "4", "--tensor-parallel", "2"],
        "sequence": ["--workers", "4", "--tensor-parallel", "2", "--sequence-parallel"],
    }.items():
        name, strategy = (name, "tensor") if name == "sequence" else (name, name)
        out = tmp_path / f"{name}.json"
        result = cli(*common, "--strategy", strategy, *extra, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    assert "ranks replica 0: [0, 1] | replica 1: [2, 3]" in result.stdout
    assert "activations between them split by position" in result.stdout
    assert results["tensor"]["global_steps"] == results["allreduce"]["global_steps"] == 12
    for name in ("tensor", "sequence"):  # sequence parallelism: the same sums, scattered and gathered
        assert results[name]["test_loss"] == pytest.approx(results["allreduce"]["test_loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--workers", "3"], "--workers 3 is not a multiple of --tensor-parallel 2"),
        (["--tp-plan", "{not json"], "--tp-plan: not JSON"),
        (["--workers", "4", "--shard-replicas", "--checkpoint-dir", "ck"], "--checkpoint-dir with --shard-replicas"),
        (["--tp-plan", '{"transformer.h.*.mlp.c_fc": "diagonal"}'], "has style 'diagonal'; the styles are"),
        (["--tp-plan", '{"transformer.h.*.mlp.fc9": "colwise"}'], "'transformer.h.*.mlp.fc9' names no module"),
        (["--tp-plan", '{"transformer.h.*.ln_1": "colwise"}'], "is a LayerNorm; colwise splits nn.Linear"),
        (["--tensor-parallel", "3"], "transformer.wte has 64 input rows, not a multiple of 3"),
        (
            ["--tensor-parallel", "3", "--tp-plan", '{"transformer.h.*.attn": "heads"}'],
            "transformer.h.0.attn.num_heads = 2, not a multiple of 3",
        ),
        (
            ["--tensor-parallel", "3", "--tp-plan", '{"transformer.wte": "rowwise"}'],
            "transformer.wte has 64 input rows, not a multiple of 3",
        ),
        (
            ["--tensor-parallel", "3", "--tp-plan", '{"transformer.h.*.attn.c_attn": "colwise:3"}'],
            "has 96 output features in 3 packed projections, not a multiple of 9",
        ),
    ],
)
def test_a_run_that_cannot_be_split_is_one_line_and_exit_2(cli, tmp_path, flags, says):
    (tmp_path / "hfgpt.py").write_text(PROJECT)
    result = cli(
        "train",
        "--model",
        "hfgpt:model",
        "--dataset",
        "hfgpt:data",
        "--loss",
        "model",
        "--metrics",
        "",
        "--strategy",
        "tensor",
        *flags,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if not line.startswith("[transformers]")]
    assert says in result.stderr and len(ours) == 1, result.stderr


def test_options_of_tensor_parallelism_are_refused_by_other_strategies(cli):
    result = cli("train", "--strategy", "allreduce", "--tensor-parallel", "2")
    assert result.returncode == 2 and "--tensor-parallel" in result.stderr and "tensor" in result.stderr


@PACKED_TP
@pytest.mark.parametrize(
    ("before", "after", "saving"),
    [
        (
            ["--workers", "2", "--tensor-parallel", "2", "--batch-size", "8"],
            ["--workers", "1", "--tensor-parallel", "1", "--batch-size", "8"],
            [],
        ),
        (
            ["--workers", "4", "--tensor-parallel", "2", "--batch-size", "4"],
            ["--workers", "2", "--tensor-parallel", "2", "--batch-size", "8"],
            [],
        ),
        # background saves resumed: test_fsdp.py's sharded checkpoints [saved in the background]
        pytest.param(
            ["--workers", "2", "--tensor-parallel", "2", "--batch-size", "8"],
            ["--workers", "1", "--tensor-parallel", "1", "--batch-size", "8"],
            ["--checkpoint-async", "--checkpoint-every", "3"],
            marks=pytest.mark.matrix,
        ),
    ],
    ids=["2-way-then-whole", "2x2-mesh-then-2-way", "2-way-saved-in-the-background-then-whole"],
)
def test_a_checkpoint_resumes_on_another_degree_and_mesh_as_the_run_never_stopped(cli, tmp_path, before, after, saving):
    """One epoch split as ``before``, then one more from its checkpoint split as ``after``
    (the same global batch): the test loss of the run that never stopped, to the rounding of
    the sums (SGD). ``saving``: the split run saves in the background every 3 steps while it
    trains (DCP's async_save). DCP reads the model and optimizer into the other layout; the packed
    query-key-value, written as contiguous shards, comes back as the slices of each
    projection; the data position goes on by replicas. No dropout: the processes of a split
    layer draw its dropout masks from other streams than one process does."""
    (tmp_path / "hfgpt.py").write_text(
        PROJECT.replace("n_head=2)", "n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)")
    )
    common = [
        "train",
        "--model",
        "hfgpt:model",
        "--dataset",
        "hfgpt:data",
        "--loss",
        "model",
        "--metrics",
        "",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--no-progress",
        "--strategy",
        "tensor",
    ]
    straight = tmp_path / "straight.json"
    result = cli(*common, *before, "--epochs", "2", "--metrics-out", str(straight), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = cli(*common, *before, "--epochs", "1", "--checkpoint-dir", "ck", *saving, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed.json"
    result = cli(
        *common,
        *after,
        "--epochs",
        "2",
        "--checkpoint-dir",
        "ck",
        "--resume",
        "--metrics-out",
        str(resumed),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    metrics, expected = json.loads(resumed.read_text()), json.loads(straight.read_text())
    assert metrics["global_steps"] == expected["global_steps"]
    assert metrics["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)
