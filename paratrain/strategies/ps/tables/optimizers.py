"""How a shard steps its table rows: lazily, only the rows a gradient touched.

A dense optimizer moves every row each step (momentum, weight decay, Adam's moments), which is what makes a
table too large to train; each kind here keeps its state per row and updates a row only when a gradient
reaches it, as TensorFlow's sparse optimizers and TorchRec's fused ones do: ``sgd`` (lazy momentum),
``adagrad`` (row-wise, one float a row), ``lazy-adam`` (``torch.optim.SparseAdam``'s rule). Under AdamW the
touched rows decay first; under the others weight decay joins the gradient. With plain SGD a table trains
exactly as in one process. The kind follows the user's optimizer unless ``--table-optimizer`` names one.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.errors import ConfigError

KINDS = ("auto", "sgd", "adagrad", "lazy-adam")
_FOLLOWS = {"sgd": "sgd", "adagrad": "adagrad", "adam": "lazy-adam", "adamw": "lazy-adam"}


def table_kind(optimizer: str, kind: str) -> str:
    """The kind that steps the rows: ``kind``, or with ``auto`` the one that follows
    ``optimizer`` (the user's optimizer's class name, or an ``--optimizer`` name)."""
    if kind not in KINDS:
        raise ConfigError(f"--table-optimizer must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    if optimizer.lower() not in _FOLLOWS:
        raise ConfigError(
            f"tables on the parameter server step lazily with sgd, adagrad or lazy-adam; {optimizer} has no lazy "
            "form: give --table-optimizer"
        )
    return _FOLLOWS[optimizer.lower()]


class RowOptimizer:
    """One table shard's rows ``rows`` (local, float32) stepped by ``kind`` with the
    hyper-parameters of ``group`` (a parameter group of the user's optimizer)."""

    def __init__(self, kind: str, group: dict[str, Any], rows: torch.Tensor, decoupled: bool = False):
        self.kind, self.rows = kind, rows
        self.lr = float(group["lr"])
        self.weight_decay = float(group.get("weight_decay", 0.0))
        self.decoupled = decoupled  # AdamW: decay the weights, not the gradient
        self.momentum = float(group.get("momentum", 0.0)) if kind == "sgd" else 0.0
        self.dampening = float(group.get("dampening", 0.0))
        self.nesterov = bool(group.get("nesterov", False))
        self.eps = float(group.get("eps", 1e-10 if kind == "adagrad" else 1e-8))
        self.betas = tuple(group.get("betas", (0.9, 0.999)))
        self.state: dict[str, torch.Tensor] = {}
        self.steps = 0
        if kind == "sgd" and self.momentum:
            self.state["momentum"] = torch.zeros_like(rows)
        elif kind == "adagrad":
            initial = float(group.get("initial_accumulator_value", 0.0))
            self.state["sum"] = torch.full((len(rows),), initial)
        elif kind == "lazy-adam":
            self.state["exp_avg"] = torch.zeros_like(rows)
            self.state["exp_avg_sq"] = torch.zeros_like(rows)

    def step(self, ids: torch.Tensor, grad: torch.Tensor, lr_scale: torch.Tensor | float) -> None:
        """Step rows ``ids`` (unique) by ``grad``; ``lr_scale``: a factor, or one per row."""
        self.steps += 1
        if not len(ids):
            return
        lr = self.lr * (lr_scale.unsqueeze(1) if torch.is_tensor(lr_scale) else lr_scale)
        w = self.rows[ids]
        if self.weight_decay and not self.decoupled:
            grad = grad + self.weight_decay * w
        elif self.weight_decay:  # AdamW's decay of the touched rows' weights, whichever kind steps them
            w = w * (1 - lr * self.weight_decay)
        if self.kind == "sgd":
            update = grad
            if self.momentum:
                buf = self.state["momentum"][ids] * self.momentum + (1 - self.dampening) * grad
                self.state["momentum"][ids] = buf
                update = grad + self.momentum * buf if self.nesterov else buf
            w = w - lr * update
        elif self.kind == "adagrad":
            total = self.state["sum"][ids] + grad.pow(2).mean(1)
            self.state["sum"][ids] = total
            w = w - lr * grad / (total.sqrt().unsqueeze(1) + self.eps)
        else:
            beta1, beta2 = self.betas
            m = self.state["exp_avg"][ids].mul_(beta1).add_(grad, alpha=1 - beta1)
            v = self.state["exp_avg_sq"][ids].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            self.state["exp_avg"][ids], self.state["exp_avg_sq"][ids] = m, v
            correction1, correction2 = 1 - beta1**self.steps, 1 - beta2**self.steps
            w = w - lr * correction2**0.5 / correction1 * m / (v.sqrt() + self.eps)  # as SparseAdam
        self.rows[ids] = w

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **{k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        for key, value in self.state.items():
            value.copy_(state[key])
