"""The Trainer's default metrics on a Hugging Face model: its output is no one prediction
per example, so where the examples are dicts scored by the model's own loss there are none
(``accuracy`` failed on its output after a whole epoch of training)."""

import pytest
import torch

import paratrain

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def test_a_gpt2_on_dict_examples_trains_and_evaluates_with_the_default_metrics():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (24, 8))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    trainer = paratrain.Trainer(
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
    )
    history = trainer.fit(data, epochs=1, batch_size=8, validation_data=data, verbose=0)
    assert trainer.metrics == () and history["test_loss"][0] > 0
    assert set(trainer.evaluate(data)) == {"loss"}


def test_pairs_keep_accuracy_by_default():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    trainer = paratrain.Trainer(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        strategy=paratrain.SingleDeviceStrategy(device="cpu"),
    )
    trainer.fit((x, y), epochs=1, batch_size=8, verbose=0)
    assert trainer.metrics == ("accuracy",) and 0 <= trainer.evaluate((x, y))["accuracy"] <= 1
