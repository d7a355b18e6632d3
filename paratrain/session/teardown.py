"""Leaving a run so that no process group outlives it.

Every Gloo work remembers the Python thread-local state it was made in, and the worker thread that ran it
takes the GIL to drop it. So a group destroyed while the GIL is held (freed from a C++ holder such as a DDP
reducer) hangs joining its worker threads, and a group alive at interpreter finalization aborts the
process ("terminate called without an active exception"). The one safe end is the Python object's last
reference going away before finalization (pybind frees it with the GIL released): ``sever_groups`` takes the
groups out of everything the run wrapped, C++ holders first, and ``destroy_groups`` then drops the registry's
last references.
"""

from __future__ import annotations

import gc
import os
import types
import weakref
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from paratrain.comm.transport import ensure_process_group

#: Attributes of DistributedDataParallel that hold its group from C++, where no Python
#: reference shows: the reducer and its logger (DDP's own ``__getstate__`` drops them too).
DDP_CPP_HOLDERS = ("reducer", "logger")

#: Objects the walk never enters: code and classes lead to the whole interpreter, and a
#: model reaches no run's group through them.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)


def sever_groups(roots: Iterable[object]) -> int:
    """Take every process group out of the objects reachable from ``roots`` (wrapped models,
    pipeline schedules, optimizers): attributes and dict entries that hold a group go, a
    device mesh forgets its groups, and a DDP wrapper drops its reducer and logger. The
    objects cannot run a collective afterwards, which nothing does after a run ends.
    Returns how many references were removed."""
    removed, seen = 0, set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE) or obj is None:
            continue
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None) if not isinstance(obj, dict) else None
        if isinstance(obj, DistributedDataParallel):
            for name in DDP_CPP_HOLDERS:
                removed += attrs.pop(name, None) is not None
        table = obj if isinstance(obj, dict) else attrs
        if isinstance(table, dict):
            for key in [k for k, v in table.items() if isinstance(v, ProcessGroup)]:
                del table[key]
                removed += 1
        stack.extend(child for child in gc.get_referents(obj) if id(child) not in seen)
    return removed


def destroy_groups(collect: bool = True) -> None:
    """Destroy every process group of this process (the default one and the groups made
    from it). Takes the groups out of every DistributedDataParallel alive first (one the
    user wrapped by hand would free its group from its reducer later, the GIL held); the
    registry then holds the last references, and letting them go runs each group's
    destructor with the GIL released. ``collect=False`` when garbage was just collected."""
    if dist.is_initialized():
        if collect:
            gc.collect()  # cycles (trainer <-> callbacks) that still reach a group
        sever_groups(live_ddps())
        dist.destroy_process_group()


def live_ddps() -> list[DistributedDataParallel]:
    """Every DistributedDataParallel (or subclass) alive in this process: one pass over the
    collector's objects by exact type (``isinstance`` on each of ~10^5 objects costs ~0.1 s,
    paid at every teardown)."""
    ddp_types = _subclasses(DistributedDataParallel)
    objects = gc.get_objects()
    if ddp_types.isdisjoint(map(type, objects)):
        return []
    return [obj for obj in objects if type(obj) in ddp_types]


def _subclasses(cls: type) -> set[type]:
    found = {cls}
    for sub in cls.__subclasses__():
        found |= _subclasses(sub)
    return found


def gloo_threads() -> list[str]:
    """The names of this process's Gloo worker threads (Linux): none once every group is gone."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as file:
                name = file.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name == "pt_gloo_runloop":
            names.append(name)
    return names


class GroupLease:
    """One strategy's hold on the process groups: whether it formed the default group (it
    then destroys it when it leaves; one that joined an existing group leaves it be) and
    the objects it wrapped that hold groups (a DDP or FSDP model, a pipeline schedule),
    whose groups it takes out when it leaves."""

    def __init__(self) -> None:
        self.owns_group = False
        self._wrapped: list[weakref.ref[Any]] = []

    def join(self, backend: str, timeout: float) -> None:
        """Join the default process group, or form it."""
        self.owns_group = self.owns_group or not dist.is_initialized()
        ensure_process_group(backend, timeout)

    def track(self, wrapper: Any) -> Any:
        self._wrapped.append(weakref.ref(wrapper))
        return wrapper

    def release(self) -> None:
        """Take the groups out of the wrapped objects the user may still hold (a wrapper freed
        during interpreter shutdown would free its group then, and abort the process; one the
        user keeps cannot train after, as after DDP's own pickling), then destroy the groups
        if this lease formed them (``destroy_groups``). Garbage is collected once (a full
        collection costs ~0.15 s once torch is imported)."""
        if not self._wrapped and not self.owns_group:
            return
        gc.collect()
        sever_groups(wrapper for wrapper in (ref() for ref in self._wrapped) if wrapper is not None)
        self._wrapped.clear()
        if self.owns_group:
            destroy_groups(collect=False)
            self.owns_group = False
