"""``pool_before_relu``: a ReLU followed by a max-pooling, in an ``nn.Sequential``, computes the pooling first.

ReLU is monotone, so the maximum of ReLUs over a window is the ReLU of the maximum, and the gradient reaches
the same input (ties resolve to the first position both ways): a step is bit for bit the model's as written,
with the ReLU on a quarter of the elements. The moved ReLU is a new in-place module, so a ReLU used elsewhere
keeps its setting. Only ``nn.Sequential`` pairs without hooks are rewritten (their order is their
computation; a hook would see a different value). ``CpuTuning(pool_before_relu=False)`` or
``--no-pool-before-relu`` keeps the model as written.
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
