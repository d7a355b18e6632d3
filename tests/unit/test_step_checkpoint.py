"""StepCheckpoint: model + optimizer every N steps, written atomically, read with weights_only."""

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.train.callbacks import StepCheckpoint


def _fit(tmp_path, epochs=1, **options):
    torch.manual_seed(0)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                strategy=paratrain.SingleDeviceStrategy(device="cpu"))
    checkpoint = StepCheckpoint(tmp_path, **options)
    trainer.fit(splits.train, epochs=epochs, verbose=0, callbacks=[checkpoint])
    return trainer, checkpoint


def test_saves_every_n_steps_and_at_the_end_keeping_the_last_few(tmp_path):
    trainer, _ = _fit(tmp_path, every_steps=10, keep=2)  # 44 steps: saves 10, 20, 30, 40, 44
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt-40.pt", "model.ckpt-44.pt"]
    state = StepCheckpoint.load(tmp_path / "model.ckpt-44.pt")
    assert state["step"] == 44 and state["epoch"] == 1
    for name, tensor in trainer.module.state_dict().items():
        assert torch.equal(state["model"][name], tensor)
    restored = torch.optim.SGD(trainer.module.parameters(), lr=0.05, momentum=0.9)
    restored.load_state_dict(state["optimizer"])  # momentum buffers come back


class Custom:
    """Any class: loading it would run the pickle's code, which weights_only refuses."""


def test_load_refuses_files_that_are_not_plain_tensors(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": Custom()}, path)
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        StepCheckpoint.load(path)
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConfigError, match="cut.pt: not a readable checkpoint"):
        StepCheckpoint.load(tmp_path / "cut.pt")
    with pytest.raises(ConfigError, match="no such file"):
        StepCheckpoint.load(tmp_path / "absent.pt")
