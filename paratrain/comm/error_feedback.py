"""Error feedback: a wrapper that makes a biased codec converge like the uncompressed one.

What a biased codec drops this step is not lost, it is sent later (Seide et al. 2014,
"1-bit SGD"; analysed by Stich et al. 2018 and Karimireddy et al. 2019)::

    corrected = gradient + residual[key]
    payload, ctx = codec.compress(corrected, key)
    residual[key] = corrected - codec.decompress(payload, ctx)   # exactly what was not sent

Every value a worker computed is sent eventually: the sum of what it sent over s steps
plus its current residual equals the sum of its s gradients. The residual is local to
each worker (it is never sent) and is part of a checkpoint. A gradient that is not finite
leaves the residual as it was (its step is skipped).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from paratrain.comm.codecs import Codec, Context, Payload


class ErrorFeedback(Codec):
    """``ErrorFeedback(TopKCodec(0.01))``: ``inner``'s payloads, with residuals carried over."""

    def __init__(self, inner: Codec):
        self.inner = inner
        # state: what compress did not send yet, per key, in the gradient's dtype and device
        self.residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def name(self) -> str:  # type: ignore[override]
        """The wrapped codec's name: ``topk`` and ``powersgd`` come with error feedback."""
        return self.inner.name

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.inner.summable

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        residual = self.residuals.get(key)
        if residual is None:
            corrected = tensor.detach()
        elif residual.shape != tensor.shape:
            raise ValueError(
                f"error feedback for {key!r}: the residual has shape {tuple(residual.shape)}, "
                f"the gradient {tuple(tensor.shape)}; each key must name one tensor"
            )
        else:
            corrected = tensor.detach() + residual.to(tensor.device)
        payload, ctx = self.inner.compress(corrected, key)
        left = corrected - self.inner.decompress(payload, ctx)
        # A gradient with an Inf or NaN (an fp16 overflow, --on-nan skip) makes a step that is
        # skipped: its residual would hold NaN for good, so the one before it is kept.
        if bool(torch.isfinite(left).all()):
            self.residuals[key] = left
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return self.inner.wire_bytes(shape, dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = dict(state.get("residuals", {}))
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
