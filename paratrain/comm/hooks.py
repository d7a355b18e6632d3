"""Codecs as DDP communication hooks: what ``allreduce`` sends for each bucket of gradients.

``make_hook(codec)`` picks the hook from a table: none for ``none`` (DDP's all-reduce), PyTorch's own for
``fp16``, ``bf16`` and ``powersgd``, and ``AllGatherHook`` for ``int8``, ``topk`` and any other codec, whose
payloads (per-chunk scales, per-rank indices) cannot be added. Every rank decodes the same bytes in rank
order, so every rank computes bit-identical averaged gradients. ``bytes_sent`` counts exactly what this rank
hands to the collectives (payload plus metadata), not the backend's own traffic (docs/compression.md).

No ``from __future__ import annotations`` here: DDP checks that a hook's ``bucket`` annotation *is*
``dist.GradBucket``, and a string is not.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from paratrain.comm.average import pack, unpack
from paratrain.comm.codecs import BF16Codec, Codec, FP16Codec, IdentityCodec, PowerSGDCodec
from paratrain.comm.error_feedback import ErrorFeedback

Future = torch.futures.Future[torch.Tensor]


class _CudaOfTheBucket:
    """``torch.cuda`` as PyTorch's ``powerSGD_hook`` sees it. The hook synchronises its
    bucket's device whenever CUDA is available, also when the bucket is in host memory (a
    model trained on the CPU of a machine with a GPU), where ``torch.cuda.synchronize``
    raises "Expected a cuda device, but got: cpu". Here it synchronises CUDA devices only."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if device is None or torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


class _TorchOfTheHook:
    """``torch`` for that module, its ``cuda`` replaced (everything else is torch's own)."""

    cuda = _CudaOfTheBucket()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


torch_powersgd.torch = _TorchOfTheHook()


class CommHook:
    """A DDP communication hook with explicit state and an exact byte counter.

    ``hook.register(ddp)`` installs it; ``hook.bytes_sent`` is what this rank has handed
    to collectives so far; ``state_dict``/``load_state_dict`` carry its state through a
    checkpoint (tensors and plain values only).
    """

    def __init__(self, codec: Codec, process_group: Any = None):
        self.codec = codec
        self.process_group = process_group
        self.bytes_sent = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, type(self).communicate)

    @staticmethod
    def communicate(state: Any, bucket: dist.GradBucket) -> Future:
        """The hook DDP calls with this object as ``state``, once per bucket per step."""
        raise NotImplementedError

    def step_bytes(self, model: nn.Module) -> int:
        """Bytes this rank sends in one step for ``model`` (the formula ``bytes_sent`` meets)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_sent = int(state.get("bytes_sent", 0))


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class CastHook(CommHook):
    """fp16 or bf16 through PyTorch's own hook, which divides by N before the cast."""

    def __init__(self, codec: Codec, torch_hook: Callable[..., Future], process_group: Any = None):
        super().__init__(codec, process_group)
        self.torch_hook = torch_hook
        self.itemsize = torch.empty((), dtype=codec.wire_dtype).element_size()

    @staticmethod
    def communicate(state: "CastHook", bucket: dist.GradBucket) -> Future:
        state.bytes_sent += bucket.buffer().numel() * state.itemsize
        return state.torch_hook(state.process_group, bucket)

    def step_bytes(self, model: nn.Module) -> int:
        return sum(p.numel() for p in _trainable(model)) * self.itemsize


@dataclass(frozen=True)
class _BucketLayout:
    """Which parameters a DDP bucket holds, where in its flat buffer, in which shapes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @staticmethod
    def of(bucket: dist.GradBucket, names: dict[torch.Tensor, str]) -> "_BucketLayout":
        buffer, gradients = bucket.buffer(), bucket.gradients()
        return _BucketLayout(
            tuple(names[p] for p in bucket.parameters()),
            tuple(tuple(g.shape) for g in gradients),
            tuple((g.data_ptr() - buffer.data_ptr()) // g.element_size() for g in gradients),
        )


class PowerSGDHook(CommHook):
    """PyTorch's layer-wise ``powerSGD_hook`` (Vogels et al. 2019) on a ``PowerSGDState``.

    The first ``start_iter`` steps are plain all-reduces (DDP rebuilds its buckets after step 1). PyTorch keeps
    the state (error, P, Q) per bucket; checkpoints hold it per parameter, and it is re-laid out whenever the
    buckets differ from those it was made for, so a resumed run continues exactly where the saved one was.
    """

    def __init__(self, codec: Codec, process_group: Any = None, start_iter: int = 2):
        super().__init__(codec, process_group)
        self.powersgd: PowerSGDCodec = codec.inner if isinstance(codec, ErrorFeedback) else codec
        self.state = torch_powersgd.PowerSGDState(
            process_group,
            matrix_approximation_rank=self.powersgd.rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=self.powersgd.min_compression_rate,
            use_error_feedback=isinstance(codec, ErrorFeedback),
            warm_start=True,
            # A column of zeros (a dead unit, a constant input pixel) would otherwise
            # divide by zero in the Gram-Schmidt step; PyTorch suggests 1e-8.
            orthogonalization_epsilon=1e-8,
            random_seed=self.powersgd.seed,
        )
        self.names: dict[torch.Tensor, str] = {}
        self.layouts: dict[int, _BucketLayout] = {}  # bucket index -> layout of its state
        self.compressed_at: dict[int, int] = {}  # bucket index -> the iteration it last ran
        self.parked: dict[str, dict[str, torch.Tensor]] = {}  # name -> its error, p, q
        self.pending: Future | None = None  # the last bucket's collectives

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.names = {p: name for name, p in ddp.module.named_parameters()}
        super().register(ddp)

    @staticmethod
    def communicate(state: "PowerSGDHook", bucket: dist.GradBucket) -> Future:
        # PyTorch's hook starts its P and Q all-reduces from the previous collective's
        # callback, on another thread; with several buckets, the ranks could then start
        # the collectives of two buckets in different orders, and Gloo pairs collectives
        # by order: a hang (reproduced: cifar_cnn in 4 buckets). One bucket at a time keeps the
        # order identical on every rank, at the price of the overlap between buckets.
        if state.pending is not None:
            state.pending.wait()
        state.pending = future = state._communicate(bucket)
        return future

    def _communicate(self, bucket: dist.GradBucket) -> Future:
        powersgd = self.state
        buffer = bucket.buffer()
        index = bucket.index()
        if powersgd.iter < powersgd.start_powerSGD_iter:
            self.bytes_sent += buffer.numel() * buffer.element_size()
            return torch_powersgd.powerSGD_hook(powersgd, bucket)  # a plain all-reduce
        layout = _BucketLayout.of(bucket, self.names)
        if self.layouts.get(index) != layout:
            self._park(powersgd.iter)
            self._unpark(bucket, layout)
        self.compressed_at[index] = powersgd.iter
        before = powersgd.total_numel_after_compression
        future = torch_powersgd.powerSGD_hook(powersgd, bucket)
        # The hook adds, per tensor, r(n + m) when it sends P and Q, else n*m: exactly
        # the elements it hands to its two all-reduces.
        self.bytes_sent += (powersgd.total_numel_after_compression - before) * buffer.element_size()
        return future.then(functools.partial(self._finite_state, index))

    def _finite_state(self, index: int, done: Future) -> torch.Tensor:
        """A bucket's gradient that held an Inf or NaN (its step skipped: an fp16 overflow)
        leaves NaN in its residual and its warm-start Q, which every later step would carry:
        dropped, so the next step starts them again (a zero residual, a fresh Q)."""
        s = self.state
        if any(
            table.get(index) is not None and not bool(torch.isfinite(table[index]).all())
            for table in (s.error_dict, s.q_memory_dict, s.p_memory_dict)
        ):
            for table in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
                table.pop(index, None)
        return done.value()

    def _form(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(n, m, r) as PyTorch's hook views a tensor, with r = 0 for tensors it sends raw."""
        if not shape:
            return (1, 1, 0)
        n = shape[0]
        m = max(1, math.prod(shape) // max(n, 1))
        r = min(n, m, self.powersgd.rank)
        compress = r * (n + m) * self.powersgd.min_compression_rate < n * m
        return (n, m, r) if compress else (n, m, 0)

    def _low_rank(self, layout: _BucketLayout) -> list[tuple[str, int, int, int]]:
        """(name, n, m, r) of the compressed tensors in the order of the bucket's P and Q
        memory: PyTorch groups them by matrix shape, shapes in order of appearance."""
        groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
        for name, shape in zip(layout.names, layout.shapes):
            n, m, r = self._form(shape)
            if r:
                groups.setdefault((n, m), []).append((name, n, m, r))
        return [entry for group in groups.values() for entry in group]

    def _split(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s state, per parameter (copies)."""
        layout, s = self.layouts[index], self.state
        out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layout.names}
        error = s.error_dict.get(index)
        if error is not None:
            for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets):
                out[name]["error"] = error[offset : offset + math.prod(shape)].view(shape).clone()
        p, q = s.p_memory_dict.get(index), s.q_memory_dict.get(index)
        if p is not None and q is not None:
            p_offset = q_offset = 0
            for name, n, m, r in self._low_rank(layout):
                out[name]["p"] = p[p_offset : p_offset + n * r].view(n, r).clone()
                out[name]["q"] = q[q_offset : q_offset + m * r].view(m, r).clone()
                p_offset, q_offset = p_offset + n * r, q_offset + m * r
        return out

    def _park(self, iteration: int) -> None:
        """Move the state of every bucket not yet run at ``iteration`` to ``parked``."""
        for index in [i for i, at in self.compressed_at.items() if at < iteration]:
            self.parked.update(self._split(index))
            for table in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
                table.pop(index, None)
            del self.layouts[index], self.compressed_at[index]

    def _unpark(self, bucket: dist.GradBucket, layout: _BucketLayout) -> None:
        """Lay the parked state of the bucket's parameters out as PyTorch expects it."""
        buffer = bucket.buffer()
        index = bucket.index()
        s = self.state
        parked = {name: self.parked.pop(name, {}) for name in layout.names}
        if s.use_error_feedback and any("error" in entry for entry in parked.values()):
            error = buffer.new_zeros(buffer.numel())
            for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets):
                if "error" in parked[name]:
                    error[offset : offset + math.prod(shape)] = parked[name]["error"].reshape(-1)
            s.error_dict[index] = error
        low_rank = self._low_rank(layout)
        if low_rank and all("p" in parked[name] and "q" in parked[name] for name, *_ in low_rank):
            s.p_memory_dict[index] = torch.cat([parked[name]["p"].reshape(-1) for name, *_ in low_rank]).to(buffer)
            s.q_memory_dict[index] = torch.cat([parked[name]["q"].reshape(-1) for name, *_ in low_rank]).to(buffer)
        self.layouts[index] = layout

    def step_bytes(self, model: nn.Module) -> int:
        """Bytes per step once compression has started (the first ``start_iter`` steps send 4n)."""
        elements = 0
        for p in _trainable(model):
            n, m, r = self._form(tuple(p.shape))
            elements += r * (n + m) if r else p.numel()
        return elements * next(model.parameters()).element_size()

    def state_dict(self) -> dict[str, Any]:
        """Per parameter: its error-feedback residual, and P and Q for the warm start."""
        s = self.state
        per_parameter = dict(self.parked)
        for index in self.layouts:
            per_parameter.update(self._split(index))
        kind, keys, position, has_gauss, cached_gaussian = s.rng.get_state()
        return {
            **super().state_dict(),
            "iter": s.iter,
            **{
                part: {name: entry[part] for name, entry in per_parameter.items() if part in entry}
                for part in ("error", "p", "q")
            },
            "numel_before": s.total_numel_before_compression,
            "numel_after": s.total_numel_after_compression,
            # numpy's generator state as a tensor and plain numbers (weights_only loading)
            "rng": {
                "keys": torch.from_numpy(keys.astype("int64")),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        s = self.state
        s.iter = int(state["iter"])
        s.total_numel_before_compression = int(state["numel_before"])
        s.total_numel_after_compression = int(state["numel_after"])
        rng = state["rng"]
        s.rng.set_state(
            ("MT19937", rng["keys"].numpy().astype("uint32"), rng["position"], rng["has_gauss"], rng["cached_gaussian"])
        )
        for table in (s.error_dict, s.p_memory_dict, s.q_memory_dict, self.layouts, self.compressed_at):
            table.clear()
        self.parked = {}
        for part in ("error", "p", "q"):
            for name, tensor in state[part].items():
                self.parked.setdefault(name, {})[part] = tensor


class AllGatherHook(CommHook):
    """Any codec, layer by layer: compress each gradient of the bucket (keyed by its
    parameter's name, so state such as error-feedback residuals follows the parameter
    even when DDP rebuilds its buckets), all-gather the packed payloads, decode every
    rank's payload in rank order and average."""

    def __init__(self, codec: Codec, process_group: Any = None):
        super().__init__(codec, process_group)
        self.names: dict[torch.Tensor, str] = {}

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.names = {p: name for name, p in ddp.module.named_parameters()}
        super().register(ddp)

    @staticmethod
    def communicate(state: "AllGatherHook", bucket: dist.GradBucket) -> Future:
        codec, buffer = state.codec, bucket.buffer()
        gradients = bucket.gradients()  # views into the bucket's buffer
        layouts, pieces = [], []
        for parameter, gradient in zip(bucket.parameters(), gradients):
            payload, ctx = codec.compress(gradient, state.names[parameter])
            data, layout = pack(payload)
            layouts.append((layout, ctx))
            pieces.append(data)
        packed = torch.cat(pieces) if pieces else buffer.new_empty(0, dtype=torch.uint8)
        state.bytes_sent += packed.numel()
        gathered = [torch.empty_like(packed) for _ in range(state.world_size)]
        work = dist.all_gather(gathered, packed, group=state.process_group, async_op=True)

        def decode(_: Any) -> torch.Tensor:
            # Everything this rank sends is in `packed`; the gradients may be overwritten.
            buffer.zero_()
            for data in gathered:
                offset = 0
                for (layout, ctx), gradient in zip(layouts, gradients):
                    payload, offset = unpack(data, offset, layout)
                    gradient.add_(codec.decompress(payload, ctx))
            return buffer.div_(len(gathered))

        return work.get_future().then(decode)

    def step_bytes(self, model: nn.Module) -> int:
        return sum(self.codec.wire_bytes(tuple(p.shape), p.dtype) for p in _trainable(model))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.codec.load_state_dict(state.get("codec", {}))


def _none(codec: Codec, group: Any) -> None:
    return None  # DDP's built-in C++ all-reduce: nothing to add


# The codecs PyTorch already ships a hook for; every other codec goes through AllGatherHook.
# Keys are exact types (a subclass may change what compress does) and, for a wrapped
# codec, (wrapper, inner): PyTorch's PowerSGD has its own error feedback.
HOOKS: dict[Any, Callable[[Codec, Any], CommHook | None]] = {
    IdentityCodec: _none,
    FP16Codec: lambda codec, group: CastHook(codec, default_hooks.fp16_compress_hook, group),
    BF16Codec: lambda codec, group: CastHook(codec, default_hooks.bf16_compress_hook, group),
    PowerSGDCodec: PowerSGDHook,
    (ErrorFeedback, PowerSGDCodec): PowerSGDHook,
}


def make_hook(codec: Codec, process_group: Any = None) -> CommHook | None:
    """The hook that carries ``codec`` in DDP, or None for DDP's own uncompressed all-reduce."""
    key = (ErrorFeedback, type(codec.inner)) if type(codec) is ErrorFeedback else type(codec)
    return HOOKS.get(key, AllGatherHook)(codec, process_group)
