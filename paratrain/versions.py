"""The PyTorch releases that parts of paratrain need beyond the package's ``torch>=2.4``.

Each part refuses an older release with one line before it starts, rather than failing
inside PyTorch at the first step. Seen on PyTorch 2.11 and 2.12 (CPU and an H200):

| part | needs | what the older releases do |
| --- | --- | --- |
| tensor parallelism of a packed projection (GPT-2's ``c_attn``, a fused ``qkv``) | 2.12 | 2.11's DTensor cannot plan a redistribution of its strided split (``ValueError: ... unable to be interpreted into a corresponding shard_order``) |
| the same with ``--sequence-parallel`` | 2.13 | 2.12's sharding propagation fails on the projection's input split by position |
| a pipeline of a traced model (a Hugging Face transformer, any model that is not a sequence of layers) | 2.13 | 2.11's pipelining asks for gradients of integer inputs; 2.12's sends a stage no gradient for a tied embedding |
"""

from __future__ import annotations

import re

import torch

from paratrain.errors import ConfigError


def torch_release() -> tuple[int, int]:
    """(major, minor) of the installed PyTorch (``2.11.0+cu130``: (2, 11))."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def require_torch(release: tuple[int, int], what: str) -> None:
    """ConfigError naming ``what`` unless the installed PyTorch is ``release`` or newer."""
    if torch_release() < release:
        wanted = f"{release[0]}.{release[1]}"
        raise ConfigError(
            f"{what} needs PyTorch {wanted} or newer (this is {torch.__version__}; docs/gpu.md says why): "
            f"pip install 'torch>={wanted}'"
        )
