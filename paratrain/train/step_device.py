"""The default device during a fit's training steps.

``strategy.scope()`` (and ``paratrain.launch``, which runs the user's function in it) makes
the strategy's device the default one where it is not already (a GPU), so that a model built
inside lands there. PyTorch implements a default device as a torch function mode: every
torch call goes through Python to it, though only factory calls made without a device
(``torch.zeros(n)``) read it. In a step of a small model on a fast device, that is host time
the device waits for.

So a fit's first step runs under a probe that places such calls as the mode does and notes
them. A step that made none (models pass ``device=`` or take it from their inputs, as
Hugging Face's do) needs no default device: the later steps run without the mode. A step
that made one keeps the mode for every step, and the chief says once which call it was."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily
from torch.utils._device import DeviceContext, _device_constructors


class _Probe(TorchFunctionMode):
    """A default device that notes the first factory call that reads it."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.reader: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = self.device
            if self.reader is None:
                self.reader = f"torch.{getattr(func, '__name__', func)}"
        return func(*args, **kwargs)


class StepDevice:
    """Wraps each training step of one fit (``with step_device():``); ``report`` takes the
    line that says a step keeps the default device."""

    def __init__(self, report: Callable[[str], None]):
        self.needed: bool | None = None
        """Whether a step reads the default device; None until the first step under one."""
        self.report = report

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        mode = _get_current_function_mode()
        if not isinstance(mode, DeviceContext) or self.needed:
            yield  # no default device set over this step (or the step reads it): as it is
            return
        with _pop_mode_temporarily():
            if self.needed is False:
                yield
                return
            with _Probe(mode.device) as probe:
                yield
        self.needed = probe.reader is not None
        if self.needed:
            self.report(
                f"the training step makes a tensor without a device ({probe.reader}): every step keeps "
                f"{mode.device} as the default device, which costs host time on each torch call "
                "(pass device=, e.g. the inputs' device, to save it)"
            )
