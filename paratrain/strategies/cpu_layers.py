"""``onednn_layers``: on the CPU, linear layers and 2-d convolutions train through oneDNN's fastest kernels
where PyTorch's defaults take a slower one (``benchmarks/cpu_layers.py`` measures both).

MKL keeps its fastest paths for Intel processors, so on any other x86-64 (``mkl_slow_here``) ``nn.Linear`` (and
transformers' ``Conv1D``) runs forward and backward through oneDNN: a rule, not a timing, so every process of
a run and a resumed run compute with the same kernels. ``nn.Conv2d``'s bias gradient is summed apart, faster
than oneDNN's fused pass (only its order differs). A module keeps its class, parameters and state-dict keys
(its instance gets a picklable ``forward``; one that has its own is left alone), and computes as its class
does outside float32 on the CPU, with DTensor parameters, or under autocast or ``torch.compile``.
``CpuTuning(onednn_layers=False)`` (``--no-onednn-layers``) keeps PyTorch's kernels; ``True`` uses oneDNN on
any processor.
"""

from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN (float32, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def available() -> bool:
    """Whether this PyTorch has oneDNN and its linear operator (every x86-64 build)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def cpu_vendor() -> str | None:
    """The processor's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...), or None where
    /proc/cpuinfo does not say (not Linux, not x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def mkl_slow_here() -> bool:
    """Whether PyTorch's matrix products run on MKL on an x86-64 processor not Intel's."""
    vendor = cpu_vendor()
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkl.is_available()
        and vendor is not None
        and vendor != "GenuineIntel"
    )


def _plain(*tensors: torch.Tensor | None) -> bool:
    """Dense float32 CPU tensors of no subclass (a DTensor or a wrapper subclass computes its own way)."""
    return all(
        t is None
        or (
            type(t) in (torch.Tensor, nn.Parameter)
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.layout == torch.strided
        )
        for t in tensors
    )


def _fast_path(*tensors: torch.Tensor | None) -> bool:
    return (
        _plain(*tensors)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.jit.is_scripting()
    )


class _LinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias``; ``transposed``: the weight is kept as [in, out] (transformers'
    ``Conv1D``), and its gradient is made in that order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> Any:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.transposed = transposed
        return _linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()  # a sum's gradient comes expanded (zero strides)
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        out_in = weight.t() if ctx.transposed else weight  # [out, in]
        if torch.is_grad_enabled():  # create_graph: a graph of differentiable operations
            grad_x = grad @ out_in if need_x else None
            grad_weight = (
                (flat_x.t() @ flat_grad if ctx.transposed else flat_grad.t() @ flat_x) if need_weight else None
            )
        else:
            grad_x = _linear(grad, out_in.t(), None) if need_x else None
            if not need_weight:
                grad_weight = None
            elif ctx.transposed:
                grad_weight = _linear(flat_x.t(), flat_grad.t(), None)
            else:
                grad_weight = _linear(flat_grad.t(), flat_x.t(), None)
        return grad_x, grad_weight, flat_grad.sum(0) if need_bias else None, None


def onednn_linear_forward(module: nn.Module, transposed: bool, input: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward pass through oneDNN where the fast path serves, else its class's."""
    if not input.numel() or not _fast_path(input, module.weight, module.bias):  # oneDNN takes no empty product
        return type(module).forward(module, input)
    if torch.is_grad_enabled() and (input.requires_grad or module.weight.requires_grad):
        return _LinearFunction.apply(input, module.weight, module.bias, transposed)
    return _linear(input.contiguous(), module.weight.t() if transposed else module.weight, module.bias)


class _ConvBiasApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, layout: tuple) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layout = layout
        stride, padding, dilation, groups = layout
        return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, [0, 0], groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        stride, padding, dilation, groups = ctx.layout
        grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, stride, padding, dilation, False, [0, 0], groups, [need_x, need_weight, False]
        )
        return grad_x, grad_weight, grad.sum((0, 2, 3)) if need_bias else None, None


def _symmetric_padding(conv: nn.Conv2d) -> list[int] | None:
    """The convolution's zero padding as two numbers, or None where it pads otherwise
    (another mode, or ``"same"`` with more on one side)."""
    if conv.padding_mode != "zeros":
        return None
    if conv.padding == "valid":
        return [0, 0]
    if conv.padding == "same":
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return None if any(t % 2 for t in totals) else [t // 2 for t in totals]
    return list(conv.padding)


def bias_apart_conv_forward(module: nn.Conv2d, input: torch.Tensor) -> torch.Tensor:
    """A convolution's forward pass whose backward pass sums the bias gradient apart, where
    the fast path serves, else its class's."""
    padding = _symmetric_padding(module)
    if (
        padding is None
        or input.dim() != 4  # an unbatched image: PyTorch's own conv2d adds the batch
        or module.bias is None
        or not torch.is_grad_enabled()
        or not module.bias.requires_grad
        or not _fast_path(input, module.weight, module.bias)
    ):
        return type(module).forward(module, input)
    layout = (list(module.stride), padding, list(module.dilation), module.groups)
    return _ConvBiasApart.apply(input, module.weight, module.bias, layout)


def _transformers_conv1d() -> type | None:
    """transformers' ``Conv1D`` where transformers is imported already, else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def use_onednn_layers(model: nn.Module, linear: bool | None) -> None:
    """Give ``model``'s ``nn.Linear`` and transformers ``Conv1D`` modules (where ``linear``,
    or None: where ``mkl_slow_here``) and its ``nn.Conv2d`` modules with a bias, of exactly
    those classes and without a ``forward`` of their own, the forward passes above."""
    if not available():
        return
    if linear is None:
        linear = mkl_slow_here()
    conv1d = _transformers_conv1d()
    for module in model.modules():
        kind = type(module)
        if "forward" in vars(module):
            continue
        if linear and (kind is nn.Linear or (conv1d is not None and kind is conv1d)):
            module.forward = functools.partial(onednn_linear_forward, module, kind is not nn.Linear)
        elif kind is nn.Conv2d and module.bias is not None:
            module.forward = functools.partial(bias_apart_conv_forward, module)


def _served_by(module: nn.Module, function: Any) -> bool:
    return getattr(vars(module).get("forward"), "func", None) is function


def describe(model: nn.Module, linear: bool | None) -> str | None:
    """The line logged at the start (``linear`` as passed to ``use_onednn_layers``), or
    None where nothing changed."""
    linears = sum(_served_by(m, onednn_linear_forward) for m in model.modules())
    convs = sum(_served_by(m, bias_apart_conv_forward) for m in model.modules())
    parts = []
    if linears:
        why = "as asked" if linear else f"MKL keeps its fastest paths for Intel's processors; this is {cpu_vendor()}"
        parts.append(f"{linears} linear layer(s) through oneDNN ({why})")
    if convs:
        parts.append(f"{convs} convolution(s) with the bias gradient apart")
    return "--onednn-layers: " + "; ".join(parts) if parts else None
