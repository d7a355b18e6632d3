"""``paratrain env``: what this machine offers a run, as one table.

PyTorch's version, the devices (CUDA count and names), the ``torch.distributed``
backends built in (Gloo, NCCL, MPI), and whether two local processes can really
all-reduce over Gloo on loopback: the check that a firewall, a missing loopback
interface or a broken install fails before a training run does.
"""

from __future__ import annotations

import platform
import time
from typing import Any

from paratrain.comm.transport import ensure_process_group
from paratrain.console import console
from paratrain.errors import ParatrainError
from paratrain.launch.local import launch
from paratrain.session.teardown import destroy_groups


def loopback_all_reduce() -> float:
    """Run on each of 2 processes: all-reduce this rank's ``rank + 1``; the sum (3.0)."""
    import torch
    import torch.distributed as dist

    ensure_process_group("gloo", 30.0)
    try:
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        return value.item()
    finally:
        destroy_groups()


def check_gloo() -> tuple[bool, str]:
    """Whether a 2-process Gloo all-reduce on loopback works, and what happened."""
    started = time.perf_counter()
    try:
        results = launch(loopback_all_reduce, num_processes=2)
    except (ParatrainError, RuntimeError, OSError) as error:
        return False, str(error).splitlines()[0] if str(error) else type(error).__name__
    seconds = time.perf_counter() - started
    if results != [3.0, 3.0]:
        return False, f"all-reduce of 1 + 2 gave {results}"
    return True, f"2 processes, all-reduce of 1 + 2 = 3 ({seconds:.1f} s including start-up)"


def environment(gloo_check: bool = True) -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    rows: list[tuple[str, str]] = [
        ("python", platform.python_version()),
        ("pytorch", torch.__version__),
        ("cuda build", torch.version.cuda or "none (CPU build)"),
    ]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows.append(("cuda devices", str(count)))
    for index in range(count):
        rows.append((f"cuda:{index}", torch.cuda.get_device_name(index)))
    rows.append(("cpu threads", str(torch.get_num_threads())))
    available = dist.is_available()
    rows.append(("torch.distributed", "available" if available else "not built"))
    for name, check in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"), ("mpi", "is_mpi_available")):
        ok = available and getattr(dist, check)()
        rows.append((f"backend {name}", "yes" if ok else "no"))
    if gloo_check:
        ok, detail = check_gloo() if available else (False, "torch.distributed is not built")
        rows.append(("gloo loopback run", ("works: " if ok else "FAILS: ") + detail))
    return rows


def env_command(args: Any) -> int:
    from rich.table import Table

    table = Table(title="paratrain env", show_header=True)
    table.add_column("what")
    table.add_column("value")
    rows = environment(gloo_check=not args.no_check)
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    return 1 if any(value.startswith("FAILS") for _, value in rows) else 0
