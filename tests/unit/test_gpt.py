"""The built-in language model (``--model gpt``) and its data (``--dataset text-lm``)."""

import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.config import TrainConfig
from paratrain.data.datasets import load_dataset
from paratrain.data.text_lm import builtin_corpus
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.models.gpt_config import GPTConfig
from paratrain.train.scores import LOSSES

SMALL = {"gpt_layers": 2, "gpt_width": 32, "gpt_heads": 2}


def _splits(tmp_path, text: bytes, seq_len=16):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text)
    return load_dataset(TrainConfig(dataset=f"text-lm:{corpus}", seq_len=seq_len))


def test_text_lm_targets_are_the_next_byte_at_every_position(tmp_path):
    text = builtin_corpus(5_000)
    splits = _splits(tmp_path, text, seq_len=16)
    inputs, targets = splits.train[3]
    assert bytes(inputs.tolist()) == text[48:64]
    assert bytes(targets.tolist()) == text[49:65]
    assert len(splits.train) == (4_500 - 1) // 16 and len(splits.test) == (500 - 1) // 16
    first_test, _ = splits.test[0]
    assert bytes(first_test.tolist()) == text[4_500:4_516]  # the last tenth, unseen in training
    assert splits.spec.per_position and splits.spec.vocab_size == 256 and splits.spec.input_shape == (16,)


def test_the_builtin_corpus_is_the_same_text_every_time():
    assert builtin_corpus(2_000) == builtin_corpus(2_000)
    assert len(builtin_corpus()) == 400_000 and builtin_corpus(2_000).decode().count(". ") > 10


def test_gpt_ties_its_output_layer_to_the_token_embedding_and_predicts_every_position(tmp_path):
    splits = _splits(tmp_path, builtin_corpus(5_000))
    model = build_model("gpt", splits.spec, options=GPTConfig(**SMALL))
    embedding, head = model[0].token.weight, model[-1].output.weight
    assert head is embedding
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in model.state_dict().values())
    inputs, _ = splits.train[0]
    assert model(inputs.unsqueeze(0)).shape == (1, 16, 256)
    assert [type(m).__name__ for m in model].count("GPTBlock") == 2 and model._no_split_modules == ["GPTBlock"]


def test_gpt_is_causal_a_later_token_changes_no_earlier_prediction():
    torch.manual_seed(0)
    spec = load_dataset(TrainConfig(dataset="text-lm", seq_len=16)).spec
    model = build_model("gpt", spec, options=GPTConfig(**SMALL)).eval()
    ids = torch.randint(0, 256, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 256
    a, b = model(ids), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_cross_entropy_of_a_sequence_is_the_mean_over_every_position():
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = sum(F.cross_entropy(logits[i, j : j + 1], targets[i, j : j + 1]) for i in range(3) for j in range(5))
    assert LOSSES["cross_entropy"]()(logits, targets).item() == pytest.approx(expected.item() / 15, rel=1e-5)
    # PyTorch's own layout, the classes second, is still taken
    image_logits, image_targets = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    assert torch.allclose(
        LOSSES["cross_entropy"]()(image_logits, image_targets), F.cross_entropy(image_logits, image_targets)
    )


def test_an_untrained_gpt_starts_at_the_loss_of_a_uniform_guess():
    torch.manual_seed(0)
    splits = load_dataset(TrainConfig(dataset="text-lm", seq_len=32))
    model = build_model("gpt", splits.spec, options=GPTConfig(**SMALL))
    inputs, targets = splits.train[0]
    loss = LOSSES["cross_entropy"]()(model(inputs.unsqueeze(0)), targets.unsqueeze(0))
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)  # weights N(0, 0.02): near-uniform outputs


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model": "mlp", "gpt_layers": 2}, "--gpt-layers applies to --model gpt, not to --model mlp"),
        ({"seq_len": 32}, "--seq-len applies to --dataset text-lm, not to --dataset digits"),
        (
            {"model": "gpt", "dataset": "text-lm", "gpt_width": 30, "gpt_heads": 4},
            "--gpt-heads 4 must divide --gpt-width 30",
        ),
        ({"model": "gpt", "dataset": "text-lm", "gpt_layers": 0}, "--gpt-layers must be >= 1"),
        ({"model": "gpt", "dataset": "text-lm", "seq_len": 0}, "--seq-len must be >= 1"),
    ],
)
def test_gpt_and_text_lm_options_are_refused_where_they_do_not_apply(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options)


def test_text_lm_data_that_cannot_be_read_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="text-lm:.*missing.txt: no such file"):
        load_dataset(TrainConfig(dataset=f"text-lm:{tmp_path / 'missing.txt'}"))
    with pytest.raises(ConfigError, match="100 bytes give no test example of --seq-len 16"):
        _splits(tmp_path, b"x" * 100, seq_len=16)


def test_gpt_refuses_data_with_one_label_per_example():
    with pytest.raises(ConfigError, match="model gpt predicts the next token at every position"):
        build_model("gpt", load_dataset(TrainConfig()).spec)


def test_a_state_dict_written_when_the_head_held_the_weight_itself_loads(tmp_path):
    splits = _splits(tmp_path, builtin_corpus(5_000))
    model = build_model("gpt", splits.spec, options=GPTConfig(**SMALL))
    state = model.state_dict()
    head = f"{len(model) - 1}."
    old = {
        (head + "weight" if key == head + "output.weight" else key): value.clone() + 1 for key, value in state.items()
    }
    model.load_state_dict(old)
    assert (
        torch.equal(model[-1].output.weight, old[head + "weight"]) and model[-1].output.weight is model[0].token.weight
    )
