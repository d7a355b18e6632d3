"""The local launcher of runs whose replicas go on without a lost one (``allreduce-ft``):
a Lighthouse in this process, one process per replica, and a lost replica replaced
alone while the others keep training.

- A replica that exits 0 is done; once one is done, training is over and no replacement
  is started (it would find nobody to take the state from).
- Bad input or a diverged model (exit 2 or 3) ends the run as everywhere else.
- A replica asked to leave (SIGTERM) finishes its step, says so, and is not replaced.
- Any other loss (a signal, an error): one line names the replica and the step it had
  reached; with restarts left (``--max-restarts``, counted over the run) a replacement
  starts in its place (``TORCHELASTIC_RESTART_COUNT`` = its incarnation) and takes the
  live state from a peer at its first quorum; without, the run goes on with the others
  while at least ``min_replicas`` are alive, and fails naming who died otherwise.
- No replica stepping for longer than ``timeout`` (a hung one): the run is stopped with
  one line naming the replicas left.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from paratrain.comm.transport import free_port
from paratrain.errors import WorkerLost, signal_name
from paratrain.launch.supervisor import failed_at, failure_message, first_failure, read_result, run_process
from paratrain.train.faults import read_progress


def supervise_replacing(
    fn: Callable[..., Any],
    args: tuple,
    num_replicas: int,
    names: list[str],
    max_restarts: int,
    min_replicas: int,
    heartbeat_timeout: float,
    timeout: float = 60.0,
) -> list[Any]:
    from paratrain.strategies.fault_tolerant import torchft_modules

    torchft_modules()
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    folder = Path(tempfile.mkdtemp(prefix="paratrain-"))
    (folder / "progress").write_bytes(bytes(8 * num_replicas))
    lighthouse = LighthouseServer(
        bind=f"127.0.0.1:{free_port()}",
        min_replicas=min_replicas,
        join_timeout_ms=1000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=int(heartbeat_timeout * 1000),
    )
    # Where the first replicas meet before their first quorum (strategies/fault_tolerant.py).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = lighthouse.address().rpartition(":")[2]
    base = {
        "NUM_REPLICA_GROUPS": str(num_replicas),
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
        "PARATRAIN_REPLICA_HOST": "127.0.0.1",
        "PARATRAIN_FT_STORE": f"127.0.0.1:{store.port}",
        "PARATRAIN_PROGRESS": str(folder / "progress"),
        "PARATRAIN_LAUNCHER_PID": str(os.getpid()),
    }
    context = multiprocessing.get_context("spawn")
    incarnation = [0] * num_replicas

    def start(slot: int) -> Any:
        tag = f"{slot}-{incarnation[slot]}"
        env = {
            **base,
            "REPLICA_GROUP_ID": str(slot),
            "TORCHELASTIC_RESTART_COUNT": str(incarnation[slot]),
            "TORCHELASTIC_ERROR_FILE": str(folder / f"error-{tag}.json"),
        }
        process = context.Process(target=run_process, args=(env, str(folder / f"result-{tag}.pkl"), fn, args))
        process.start()
        return process

    processes = [start(slot) for slot in range(num_replicas)]
    finished: set[int] = set()
    lost: set[int] = set()
    restarts = 0
    # No replica stepping for longer than --timeout (plus the time to drop a dead one): the
    # ones left are hung (a hung replica still heartbeats, and one survivor cannot outvote it).
    stall_limit = timeout + heartbeat_timeout + 5.0
    last_top, last_move = 0, time.monotonic()
    try:
        while len(finished) + len(lost) < num_replicas:
            time.sleep(0.1)
            top = max(read_progress(folder / "progress", num_replicas))
            if top != last_top:
                last_top, last_move = top, time.monotonic()
            if not finished and time.monotonic() - last_move > stall_limit:
                alive = [names[s] for s, p in enumerate(processes) if s not in lost and p.exitcode is None]
                raise WorkerLost(
                    f"no replica took a step for {stall_limit:g} s after step {last_top} (--timeout {timeout:g}); "
                    f"stopped {', '.join(alive) or 'none'}"
                )
            for slot, process in enumerate(processes):
                if slot in finished or slot in lost or process.exitcode is None:
                    continue
                code = process.exitcode
                tag = f"{slot}-{incarnation[slot]}"
                if code == 0 and (folder / f"error-{tag}.json").exists():  # left when asked (SIGTERM)
                    print(f"paratrain: {failure_message(folder, tag, code)}", file=sys.stderr, flush=True)
                    lost.add(slot)
                    continue
                if code == 0:
                    finished.add(slot)
                    continue
                failure = {slot: (code, failed_at(folder, tag, code), failure_message(folder, tag, code))}
                if code in (2, 3):
                    raise first_failure(failure, names)
                step = read_progress(folder / "progress", num_replicas)[slot]
                how = f"exit code {code}" if code > 0 else f"killed by {signal_name(-code)}"
                what = f"paratrain: {names[slot]} was lost ({how}) after step {step}"
                if not finished and restarts < max_restarts:
                    restarts += 1
                    incarnation[slot] += 1
                    print(
                        f"{what}; a replacement joins the run (restart {restarts} of {max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    processes[slot] = start(slot)
                    continue
                alive = sum(1 for s, p in enumerate(processes) if s not in lost and s != slot and p.exitcode is None)
                if not finished and alive < min_replicas:
                    raise first_failure(failure, names)
                lost.add(slot)
                if not finished:
                    print(
                        f"{what}; the run goes on with {alive} replica{'s' * (alive != 1)}", file=sys.stderr, flush=True
                    )
        if not finished:
            raise first_failure({s: (processes[s].exitcode, 0.0, "lost") for s in lost}, names)
        return [read_result(folder, f"{slot}-{incarnation[slot]}") for slot in range(num_replicas)]
    finally:
        for process in processes:
            if process.exitcode is None:  # SIGTERM would only ask it to leave after its step
                process.kill()
        for process in processes:
            process.join(timeout=10)
            if process.exitcode is None:
                process.kill()
        lighthouse.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
