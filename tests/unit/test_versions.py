"""Parts that need a newer PyTorch than the package's floor refuse an older one in one line
(paratrain/versions.py); the release is read off torch.__version__ and patched here."""

import pytest
import torch
from torch import nn

from paratrain import versions
from paratrain.errors import ConfigError
from paratrain.parallel import traced


@pytest.mark.parametrize(("version", "release"), [("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)), ("3.0.0a0", (3, 0))])
def test_the_release_is_read_off_the_version(monkeypatch, version, release):
    monkeypatch.setattr(torch, "__version__", version)
    assert versions.torch_release() == release


def test_an_older_release_is_refused_with_what_needs_it(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    versions.require_torch((2, 11), "anything")  # its own release is enough
    with pytest.raises(
        ConfigError, match=r"^thing X needs PyTorch 2.12 or newer \(this is 2.11.0\+cu130; .*'torch>=2.12'$"
    ):
        versions.require_torch((2, 12), "thing X")


def test_a_traced_pipeline_refuses_an_older_release_before_tracing(monkeypatch):
    monkeypatch.setattr(versions, "torch_release", lambda: (2, 12))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="a pipeline of Sequential .* needs PyTorch 2.13"):
        traced.trace(model, (), (torch.randn(2, 4),), ["1"])
