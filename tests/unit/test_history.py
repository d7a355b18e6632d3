"""A fit's history in checkpoints: saved as JSON, each epoch encoded once, restored exactly."""

import json
import math

import numpy as np
import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.train import history as history_module
from paratrain.train.history import History


def test_saved_history_keeps_nan_none_and_numbers_of_other_libraries():
    history = History([{"epoch": 1, "train_loss": float("nan"), "test_loss": None, "note": "diverged"}])
    history.epochs.append({"epoch": 2, "train_loss": np.float32(0.5), "test_loss": torch.tensor(0.25)})
    back = History.restored(history.saved())
    assert back.epochs[0]["epoch"] == 1 and math.isnan(back.epochs[0]["train_loss"])
    assert back.epochs[0]["test_loss"] is None and back.epochs[0]["note"] == "diverged"
    assert back.epochs[1] == {"epoch": 2, "train_loss": 0.5, "test_loss": 0.25}


def test_a_checkpoint_written_before_holds_the_epochs_as_dicts_and_still_restores():
    epochs = [{"epoch": 1, "train_loss": 0.75}, {"epoch": 2, "train_loss": 0.5}]
    assert History.restored(epochs).epochs == epochs


@pytest.mark.parametrize("saved", ['{"epoch": 1}', "[1, 2]", json.dumps([{"epoch": 1}, "x"])])
def test_a_history_that_is_not_a_list_of_epochs_is_refused(saved):
    with pytest.raises(ConfigError, match="not a list of epochs"):
        History.restored(saved)


def test_each_epoch_is_encoded_once_however_often_the_run_saves(monkeypatch):
    encoded = []
    dumps = json.dumps
    monkeypatch.setattr(history_module.json, "dumps", lambda value, **kw: encoded.append(value) or dumps(value, **kw))
    history = History([{"epoch": i} for i in range(3)])
    for _ in range(5):
        history.saved()
    history.epochs.append({"epoch": 3})
    text = history.saved()
    assert encoded == [{"epoch": i} for i in range(4)]
    assert json.loads(text) == [{"epoch": i} for i in range(4)]
    history.epochs[:] = [{"epoch": 9}]  # a list replaced by hand is encoded again
    assert json.loads(history.saved()) == [{"epoch": 9}]
