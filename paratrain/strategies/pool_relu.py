"""``pool_before_relu``: a ReLU followed by a max-pooling, in an ``nn.Sequential``, computes
the pooling first.

ReLU is monotone, so the maximum of ReLUs over a window is the ReLU of the maximum: the
same values, with the ReLU on a quarter of the elements (a 2x2 or 3x3/2 pooling). The
gradient is the same too: with the pooling first, the gradient goes to the window's
largest input, through the ReLU's derivative there; with the ReLU first, to the window's
largest ReLU output, which is that same input where it is positive, and zero (a ReLU
derivative of zero) where the whole window is not. Ties resolve to the first position both
ways. So a step is bit-for-bit the step of the model as written, only faster: a plain
conv net's ReLUs and their gradients took a quarter of its CPU step (a profile on one
core; benchmarks/tensorflow_mirrored.py's plain_cnn). The ReLU after the pooling runs in
place (on the pooling's own output, which nothing else reads; a new module, so a ReLU the
model uses elsewhere keeps its setting).

Only ``nn.Sequential`` containers are rewritten (their order is their computation), and
only pairs without hooks (a hook sees what its module computes, which would change).
TensorFlow's graph optimizer makes rewrites of this kind on its own graphs;
``CpuTuning(pool_before_relu=False)`` or ``--no-pool-before-relu`` keeps the model as written.
"""

from __future__ import annotations

from torch import nn


def _hooked(module: nn.Module) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, name, None) for name in hooks)


def pool_before_relu(model: nn.Module) -> list[str]:
    """Swap each ``nn.ReLU, nn.MaxPool2d`` pair inside ``model``'s ``nn.Sequential``s, in
    place; the names of the moved ReLUs' new places."""
    moved = []
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        keys = list(container._modules)
        k = 0
        while k < len(keys) - 1:
            relu, pool = container._modules[keys[k]], container._modules[keys[k + 1]]
            if (
                type(relu) is nn.ReLU
                and type(pool) is nn.MaxPool2d
                and not pool.return_indices
                and not _hooked(relu)
                and not _hooked(pool)
            ):
                container._modules[keys[k]] = pool
                container._modules[keys[k + 1]] = nn.ReLU(inplace=True)
                moved.append(f"{prefix}.{keys[k + 1]}" if prefix else keys[k + 1])
                k += 2
            else:
                k += 1
    return moved
