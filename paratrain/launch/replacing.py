"""The local launcher of runs whose replicas go on without a lost one (``allreduce-ft``, ``pipeline-ft``): a
Lighthouse in this process, one process per replica (per stage for a pipeline replica), and a lost replica
replaced alone, as a unit, while the others keep training.

Once a replica is done (exit 0) training is over and a lost replica is no longer replaced (nobody would have
the state). Exit 2 or 3 ends the run as everywhere; a replica asked to leave (SIGTERM) is not replaced. Any
other loss is named in one line and, with ``--max-restarts`` left (counted over the run), replaced by one
that takes the live state at its first quorum; otherwise the run goes on while ``min_replicas`` are alive.
No replica stepping for ``timeout`` seconds stops the run, naming the replicas left.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.comm.transport import host_rendezvous, host_store
from paratrain.errors import LauncherStopped, WorkerLost, signal_name
from paratrain.launch.process import launcher_env, process_context
from paratrain.launch.supervisor import (
    ends_run,
    failed_at,
    failure_message,
    first_failure,
    left_when_asked,
    read_result,
    run_process,
)
from paratrain.train.faults import mark_lost, new_progress, read_progress


def supervise_replacing(
    fn: Callable[..., Any],
    args: tuple,
    num_replicas: int,
    names: list[str],
    max_restarts: int,
    min_replicas: int,
    heartbeat_timeout: float,
    timeout: float = 60.0,
    per_replica: int = 1,
) -> list[Any]:
    """``num_replicas`` replicas of ``per_replica`` processes each (``pipeline-ft``: its
    stages, a process group of their own); ``names`` names every process. A replica is
    replaced as a unit: when one of its processes is lost, the others are stopped too."""
    from paratrain.strategies.fault_tolerant.replicas import REPLICA_STORE_ENV, torchft_modules

    torchft_modules()
    from torchft.coordination import LighthouseServer

    folder = Path(tempfile.mkdtemp(prefix="paratrain-"))
    num_processes = num_replicas * per_replica
    new_progress(folder / "progress", num_processes)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",  # the port the server binds; address() names it
        min_replicas=min_replicas,
        join_timeout_ms=1000,
        quorum_tick_ms=20,  # a quorum is formed within 20 ms of being ready
        heartbeat_timeout_ms=int(heartbeat_timeout * 1000),
    )
    # Where the first replicas meet before their first quorum (strategies/fault_tolerant/strategy.py).
    store = host_store(timeout)
    port = lighthouse.address().rpartition(":")[2]
    base = {
        "NUM_REPLICA_GROUPS": str(num_replicas),
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
        "PARATRAIN_REPLICA_HOST": "127.0.0.1",
        "PARATRAIN_FT_STORE": f"127.0.0.1:{store.port}",
        "PARATRAIN_PROGRESS": str(folder / "progress"),
        "PARATRAIN_LAUNCHER_PID": str(os.getpid()),
        # Every replica's processes share this machine: each computes with its share of the
        # cores, and processes that share a GPU join over Gloo (comm.transport.default_backend).
        "LOCAL_WORLD_SIZE": str(num_processes),
    }
    context = process_context()
    incarnation = [0] * num_replicas
    # Each replica's progress when its latest process started: one whose step moved since
    # (or an original, never replaced) holds the run's state.
    started_at = [0] * num_replicas
    stores: dict[int, Any] = {}  # each replica's rendezvous, while its processes run
    # A one-process replica's group store (where its Manager meets, and where the gradient
    # group of a quorum it leads rendezvouses), here so that it outlives the replica: the
    # others' rendezvous in a quorum whose leader was lost then ends at its deadline instead
    # of in connection retries to a closed port (strategies/fault_tolerant/quorum_group.py).
    group_stores = [host_store(timeout) for _ in range(num_replicas)] if per_replica == 1 else []

    def give_up(slot: int) -> None:
        """Replica ``slot`` is lost for good: none of its processes runs again (its chief's
        timeline waits for no part of it, train/faults.py's LOST)."""
        lost.add(slot)
        mark_lost(folder / "progress", range(slot * per_replica, (slot + 1) * per_replica))

    def start(slot: int) -> list[Any]:
        """Replica ``slot``'s processes; several form a process group of their own."""
        group: dict[str, str] = {}
        if per_replica > 1:  # the replica's own process group, in a store of this launcher's
            stores[slot], rendezvous = host_rendezvous(timeout)
            group = {**rendezvous, "WORLD_SIZE": str(per_replica)}
        started = []
        for member in range(per_replica):
            tag = _tag(slot, member, incarnation[slot], per_replica)
            env = {
                **base,
                "REPLICA_GROUP_ID": str(slot),
                "TORCHELASTIC_RESTART_COUNT": str(incarnation[slot]),
                "TORCHELASTIC_ERROR_FILE": str(folder / f"error-{tag}.json"),
                **({**group, "RANK": str(member), "LOCAL_RANK": str(member)} if per_replica > 1 else {}),
                **({REPLICA_STORE_ENV: f"127.0.0.1:{group_stores[slot].port}"} if group_stores else {}),
            }
            process = context.Process(
                target=run_process, args=(launcher_env(env), str(folder / f"result-{tag}.pkl"), fn, args)
            )
            process.start()
            started.append(process)
        return started

    def stopped(number: int, frame: Any) -> None:
        raise LauncherStopped(
            number,
            f"the launcher was sent {signal_name(number)}: every replica was stopped with it; the run goes on "
            "from its last checkpoint with --resume",
        )

    previous = _handle_signals(stopped)
    replicas = [start(slot) for slot in range(num_replicas)]
    finished: set[int] = set()
    lost: set[int] = set()
    restarts = 0
    # No replica stepping for longer than --timeout (plus the time to drop a dead one): the
    # ones left are hung (a hung replica still heartbeats, and one survivor cannot outvote it).
    stall_limit = timeout + heartbeat_timeout + 5.0
    last_top, last_move = 0, time.monotonic()
    finished_at = None  # when the first replica finished: the others follow within --timeout
    try:
        while len(finished) + len(lost) < num_replicas:
            time.sleep(0.1)
            if finished_at is None and finished:
                finished_at = time.monotonic()
            if finished_at is not None:
                unheard = _unheard(
                    f"http://127.0.0.1:{port}",
                    heartbeat_timeout,
                    [s for s in range(num_replicas) if s not in finished and s not in lost],
                    read_progress(folder / "progress", num_processes)[::per_replica],
                )
                for slot in unheard:
                    why = f"was not heard for over {heartbeat_timeout:g} s when another replica finished the run"
                    _stop_late(names[slot * per_replica], f"{why} (stopped, or its host is gone)", replicas[slot])
                    give_up(slot)
            if finished_at is not None and time.monotonic() - finished_at > timeout:
                for slot in set(range(num_replicas)) - finished - lost:
                    why = f"did not finish within --timeout {timeout:g} s of a replica that finished the run"
                    _stop_late(names[slot * per_replica], why, replicas[slot])
                    give_up(slot)
                break
            top = max(read_progress(folder / "progress", num_processes))
            if top != last_top:
                last_top, last_move = top, time.monotonic()
            if not finished and time.monotonic() - last_move > stall_limit:
                alive = [
                    names[slot * per_replica + m]
                    for slot, members in enumerate(replicas)
                    for m, p in enumerate(members)
                    if slot not in lost and p.exitcode is None
                ]
                raise WorkerLost(
                    f"no replica took a step for {stall_limit:g} s after step {last_top} (--timeout {timeout:g}); "
                    f"stopped {', '.join(alive) or 'none'}"
                )
            for slot, members in enumerate(replicas):
                if slot in finished or slot in lost:
                    continue
                codes = [p.exitcode for p in members]
                tags = [_tag(slot, m, incarnation[slot], per_replica) for m in range(per_replica)]
                left = [m for m, code in enumerate(codes) if left_when_asked(folder, tags[m], code)]
                if left:  # left when asked (SIGTERM)
                    print(f"paratrain: {failure_message(folder, tags[left[0]], 0)}", file=sys.stderr, flush=True)
                    _stop(members)
                    lost.add(slot)
                    continue
                if all(code == 0 for code in codes):
                    finished.add(slot)
                    continue
                failed = [m for m, code in enumerate(codes) if code not in (None, 0)]
                if not failed:
                    continue
                # The cause: the process that failed first (one killed without a word counts
                # as first); the others of its replica failed because it did.
                member = min(failed, key=lambda m: failed_at(folder, tags[m], codes[m]))
                _stop(members)  # a replica is replaced as a unit: its other processes go too
                code = codes[member]
                tag = tags[member]
                index = slot * per_replica + member
                failure = {index: (code, failed_at(folder, tag, code), failure_message(folder, tag, code))}
                if code in (2, 3):
                    raise first_failure(failure, names)
                progress = read_progress(folder / "progress", num_processes)
                step = progress[index]
                how = f"exit code {code}" if code > 0 else f"killed by {signal_name(-code)}"
                what = f"paratrain: {names[index]} was lost ({how}) after step {step}"
                # Training is over once another replica finished or is finishing (a process of
                # it done, none failed): a loss then needs no replacement and fails nothing (a
                # replacement started just before finds no one to take the state from).
                over = bool(finished) or any(
                    _finishing(members) for s, members in enumerate(replicas) if s != slot and s not in lost
                )
                if over:
                    give_up(slot)
                    print(f"{what}, after training had ended; the others report the run", file=sys.stderr, flush=True)
                    continue
                firsts = progress[::per_replica]  # each replica's first process's step
                others = [
                    s
                    for s, ps in enumerate(replicas)
                    if s != slot and s not in lost and any(p.exitcode is None for p in ps)
                ]
                # The run's state is gone (no other live replica holds it, so none was late
                # to the replacement's quorum): no replacement can go on.
                if ends_run(folder, tag) and not any(incarnation[s] == 0 or firsts[s] != started_at[s] for s in others):
                    raise first_failure(failure, names)
                if restarts < max_restarts:
                    restarts += 1
                    incarnation[slot] += 1
                    started_at[slot] = firsts[slot]
                    print(
                        f"{what}; a replacement joins the run (restart {restarts} of {max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    replicas[slot] = start(slot)
                    continue
                alive = len(others)
                if alive < min_replicas:
                    raise first_failure(failure, names)
                give_up(slot)
                print(f"{what}; the run goes on with {alive} replica{'s' * (alive != 1)}", file=sys.stderr, flush=True)
        if not finished:
            raise first_failure({s * per_replica: (replicas[s][0].exitcode, 0.0, "lost") for s in lost}, names)
        return [
            read_result(folder, _tag(slot, m, incarnation[slot], per_replica))
            for slot in range(num_replicas)
            for m in range(per_replica)
        ]
    finally:
        _handle_signals(None, previous)
        for members in replicas:
            _stop(members)
        lighthouse.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def _handle_signals(handler: Any, previous: dict[int, Any] | None = None) -> dict[int, Any]:
    """SIGTERM and SIGUSR1 to the launcher handled by ``handler`` (from the main thread
    only, Python's rule), or put back as ``previous``; returns the handlers replaced. The
    replicas of a fault-tolerant run leave one by one on SIGTERM, so the launcher's signal
    ends them all with it instead of leaving them and its files behind."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    if previous is not None:
        for number, old in previous.items():
            signal.signal(number, old)
        return {}
    return {number: signal.signal(number, handler) for number in (signal.SIGTERM, signal.SIGUSR1)}


def _tag(slot: int, member: int, incarnation: int, per_replica: int) -> str:
    """A process's name in the run's folder (error and result files)."""
    return f"{slot}-{incarnation}" if per_replica == 1 else f"{slot}.{member}-{incarnation}"


def _unheard(lighthouse: str, heartbeat_timeout: float, slots: list[int], steps: list[int]) -> list[int]:
    """Of ``slots``, the replicas behind the furthest (``steps``: each replica's last step)
    whose last heartbeat the Lighthouse heard over ``heartbeat_timeout`` s ago, if ever."""
    from paratrain.strategies.fault_tolerant.peers import heartbeat_ages

    try:
        ages = heartbeat_ages(lighthouse)
    except (OSError, ValueError):
        return []
    last = max(steps)

    def age(slot: int) -> float:
        return min((a for rid, a in ages.items() if rid.split(":")[0] == f"replica_{slot}"), default=float("inf"))

    return [slot for slot in slots if steps[slot] < last and age(slot) > heartbeat_timeout]


def _stop_late(name: str, why: str, processes: list[Any]) -> None:
    """A replica still running once the run is over: one line, and it is stopped."""
    print(f"paratrain: {name} {why}; stopped", file=sys.stderr, flush=True)
    _stop(processes)


def _finishing(processes: list[Any]) -> bool:
    """A replica done training: a process of it exited 0 and none failed."""
    codes = [p.exitcode for p in processes]
    return 0 in codes and all(code in (None, 0) for code in codes)


def _stop(processes: list[Any]) -> None:
    """SIGKILL at once (SIGTERM would only ask a replica to leave after its step), and reap."""
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(timeout=10)
