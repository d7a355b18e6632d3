"""Workers that join a running ps-async or ps-backup run (``--join HOST:PORT``).

A Gloo process group cannot grow, so a joiner is no rank of the run's: it meets the run in the rendezvous
store at HOST:PORT. Shard 0 publishes the run under ``RUN_KEY``, which the joiner checks its configuration
against. The joiner then posts a candidate with its protocol version (wire.py's ``MAGIC``: a Gloo link cannot
refuse a message longer than the posted buffer, so another version is refused before any link exists), and
each shard's ``JoinAdmitter`` thread challenges it for a proof under the join token (session/join_token.py).
A refused joiner exits with one line (exit 2) and nothing of the run waits for it. Proven to every shard, it
takes the next worker number and each shard makes a two-process Gloo group with it (links.PairLink); from
its first pull on it is served as any other worker. A finished run (``closed``) admits no more joiners.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from paratrain.errors import ConfigError, WorkerLost
from paratrain.session.join_token import HANDSHAKE_S, challenge, proof, proves
from paratrain.strategies.ps.protocol.links import PairLink
from paratrain.strategies.ps.protocol.wire import MAGIC

#: The key, outside any run's prefix, under which shard 0 describes the run joiners join.
RUN_KEY = "paratrain/ps-run"
#: Seconds an admitter waits for a joiner that took a number but has not asked to join, when a
#: later joiner has: then it serves the later ones.
SKIP_AFTER_S = 5.0


def pair_prefix(worker: int, shard: int) -> str:
    return f"pair/{worker}/{shard}"


def describe_run(member: Any, **facts: Any) -> None:
    """Shard 0: publish the run to joiners, in the rendezvous store (unprefixed), with where
    its keys are (``member``: membership.Membership) and its message tags."""
    member.root_store.set(RUN_KEY, json.dumps({"prefix": member.prefix, "tags": member.tags, **facts}))


class JoinAdmitter:
    """On each shard: admits the workers that join while the run serves, until ``finished``
    is set. ``admit(worker, link)`` makes the shard serve one and returns where the run
    stands (shard 0 tells the joiner)."""

    def __init__(
        self,
        store: Any,
        shard: int,
        finished: threading.Event,
        admit: Callable[[int, PairLink], dict[str, Any]],
        timeout: float,
        key: tuple[str, str],
    ):
        self.store = store
        self.shard = shard
        self.finished = finished
        self.admit = admit
        self.timeout = timeout
        self.token, self.run = key  # the run's join token (never in the store) and its name in proofs
        self.refused = 0
        self.thread = threading.Thread(target=self._run, name="ps-join-admitter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self._admit_all()
        except RuntimeError:  # the store went with the run's end (shard 0 holds it): nobody joins now
            return

    def _admit_all(self) -> None:
        candidates, joins = Requests(self.store, "candidates", "candidate"), Requests(self.store, "joins", "join")
        proven: set[int] = set()  # candidates this admitter has seen prove the token, not yet admitted
        while not self.finished.wait(0.1):
            candidate = candidates.next()
            if candidate is not None and self._speaks(candidate) and self._proven(candidate["candidate"]):
                proven.add(candidate["candidate"])
            request = joins.next()
            if request is None:
                continue
            worker = request["worker"]
            if request.get("candidate") not in proven:  # a number taken without the handshake
                self.refused += 1
                print(
                    f"paratrain: ps shard {self.shard}: refused worker {worker}: it did not prove the join token",
                    flush=True,
                )
                continue
            proven.discard(request["candidate"])
            try:  # blocks this thread (not the shard's others) until the joiner connects
                link = PairLink(self.store, pair_prefix(worker, self.shard), 0, self.timeout)
            except RuntimeError as error:
                print(f"paratrain: ps shard {self.shard}: worker {worker} could not join: {error}", flush=True)
                continue
            position = self.admit(worker, link)
            if self.shard == 0:
                self.store.set(f"joined/{worker}", json.dumps(position))
        if self.shard == 0:
            self.store.set("closed", "1")

    def _speaks(self, candidate: dict[str, Any]) -> bool:
        """Whether joiner ``candidate`` speaks this run's protocol; refused (verdict
        ``protocol``) if not, without a challenge."""
        if candidate.get("protocol") == MAGIC:
            return True
        self.refused += 1
        self.store.set(f"verdict/c{candidate['candidate']}/{self.shard}", "protocol")
        print(
            f"paratrain: ps shard {self.shard}: refused joiner {candidate['candidate']}: it speaks protocol "
            f"{candidate.get('protocol')}, the run {MAGIC:g} (another paratrain version)",
            flush=True,
        )
        return False

    def _proven(self, candidate: int) -> bool:
        """Ask joiner ``candidate`` a fresh challenge and check its answer under the join
        token; say the verdict. A joiner that does not answer within HANDSHAKE_S is refused."""
        who = f"c{candidate}"
        asked, key = challenge(), f"{who}/{self.shard}"
        self.store.set(f"challenge/{key}", asked)
        try:
            self.store.wait([f"answer/{key}"], timedelta(seconds=HANDSHAKE_S))
            answer = self.store.get(f"answer/{key}").decode()
        except (RuntimeError, UnicodeDecodeError):  # no answer in time (DistStoreError), or not text
            answer = ""
        if proves(self.token, self.run, who, self.shard, asked, answer):
            self.store.set(f"verdict/{key}", "ok")
            return True
        self.refused += 1
        self.store.set(f"verdict/{key}", "refused")
        print(
            f"paratrain: ps shard {self.shard}: refused joiner {candidate}: it did not prove the join token", flush=True
        )
        return False


class Requests:
    """The requests posted under ``key/<i>`` in the order of the ``counter`` their posters
    took numbers from: ``next()`` gives the next one, or None while it has not come."""

    def __init__(self, store: Any, counter: str, key: str):
        self.store = store
        self.counter = counter
        self.key = key
        self.index, self.missing_since = 0, None

    def next(self) -> dict[str, Any] | None:
        if self.store.add(self.counter, 0) <= self.index:  # no one has taken a number since
            return None
        if not self.store.check([f"{self.key}/{self.index}"]):
            # A joiner that took a number and died before posting holds no one up for long.
            self.missing_since = self.missing_since or time.monotonic()
            if time.monotonic() - self.missing_since > SKIP_AFTER_S:
                self.index, self.missing_since = self.index + 1, None
            return None
        request = json.loads(self.store.get(f"{self.key}/{self.index}"))
        self.index, self.missing_since = self.index + 1, None
        return request


#: Options of the run a joiner does not take: its outputs, its own worker count, restarts,
#: fault injections (they name the run's workers), and where the run keeps its join token.
NOT_TAKEN = (
    "metrics_out",
    "logdir",
    "timeline",
    "checkpoint_dir",
    "resume",
    "workers",
    "max_restarts",
    "fail",
    "fail_at",
    "fail_shard_at",
    "hang",
    "vanish",
    "terminate",
    "straggler",
    "join_token_file",
    "joiners",
)


def run_options(options: dict[str, Any]) -> dict[str, Any]:
    """What a run publishes of its options for joiners (``TrainConfig.to_dict()``'s)."""
    return {k: v for k, v in options.items() if k not in NOT_TAKEN}


def read_run(address: str, timeout: float) -> tuple[Any, dict[str, Any]]:
    """The rendezvous store at ``address`` (HOST:PORT) and what shard 0 published there."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--join must be HOST:PORT (the run's rendezvous address), got {address!r}")
    wait = timedelta(seconds=timeout)
    try:
        root = dist.TCPStore(host, int(port), is_master=False, timeout=wait)
        root.wait([RUN_KEY], wait)
    except RuntimeError as error:
        raise WorkerLost(
            f"--join {address}: no paratrain ps-async or ps-backup run answered within --timeout {timeout:g} s "
            f"({str(error).splitlines()[0]})"
        ) from None
    return root, json.loads(root.get(RUN_KEY))


REFUSED = "refused: this run needs its join token (it printed it and saved it: docs/parameter_server.md#joining)"


def join_run(address: str, facts: dict[str, Any], timeout: float, token: str | None) -> dict[str, Any]:
    """The joiner: find the run at ``address`` (HOST:PORT), check that it runs with the
    ``facts`` this worker has (strategy, shards, codecs), take a worker number, prove the join
    ``token`` to every shard, and make a link with every shard. Returns ``store`` (the
    run's prefixed store), ``run`` (what shard 0 published), ``worker``, ``links`` (one per
    shard) and ``position`` (version, epoch)."""
    root, run = read_run(address, timeout)
    if not run.get("joiners", True):
        raise ConfigError(
            f"--join {address}: refused: the run there takes no joiners (it runs with --no-joiners, or under "
            "torchrun without a join token)"
        )
    if token is None:
        raise ConfigError(f"--join {address}: {REFUSED}; give it with --join-token-file FILE or PARATRAIN_JOIN_TOKEN")
    wait = timedelta(seconds=timeout)
    differ = [key for key in facts if run.get(key) != facts[key]]
    if differ:
        raise ConfigError(
            f"--join {address}: the run there has {', '.join(f'{k}={run.get(k)}' for k in differ)}; "
            f"this worker has {', '.join(f'{k}={facts[k]}' for k in differ)}"
        )
    store = dist.PrefixStore(run["prefix"], root)
    if store.check(["closed"]):
        raise WorkerLost(f"--join {address}: the run there has finished; there is nothing to join")
    # First prove the token as a candidate; only then take a worker number, so that a
    # refused joiner moves nothing of the run's (its worker numbers stay consecutive).
    candidate = store.add("candidates", 1) - 1
    store.set(f"candidate/{candidate}", json.dumps({"candidate": candidate, "protocol": MAGIC}))
    _prove(store, address, run, f"c{candidate}", token, timeout)
    worker = run["workers"] + store.add("joins", 1) - 1
    store.set(f"join/{worker - run['workers']}", json.dumps({"worker": worker, "candidate": candidate}))
    try:
        links = [PairLink(store, pair_prefix(worker, shard), 1, timeout) for shard in range(run["shards"])]
        store.wait([f"joined/{worker}"], wait)
    except RuntimeError as error:
        raise WorkerLost(
            f"--join {address}: the shards did not take worker {worker} within --timeout {timeout:g} s "
            f"(the run may have finished; {str(error).splitlines()[0]})"
        ) from None
    position = json.loads(store.get(f"joined/{worker}"))
    return {"store": store, "run": run, "worker": worker, "links": links, "position": position}


def _prove(store: Any, address: str, run: dict[str, Any], who: str, token: str, timeout: float) -> None:
    """Answer every shard's challenge with the proof under ``token``; ConfigError (exit 2)
    where a shard refuses it."""
    wait = timedelta(seconds=timeout)
    try:
        for shard in range(run["shards"]):
            key = f"{who}/{shard}"
            store.wait([f"challenge/{key}"], wait)
            asked = store.get(f"challenge/{key}").decode()
            store.set(f"answer/{key}", proof(token, run["prefix"], who, shard, asked))
        verdicts = []
        for shard in range(run["shards"]):
            store.wait([f"verdict/{who}/{shard}"], wait)
            verdicts.append(store.get(f"verdict/{who}/{shard}").decode())
    except RuntimeError as error:
        raise WorkerLost(
            f"--join {address}: the shards did not ask this joiner to prove the join token within --timeout "
            f"{timeout:g} s (the run may have finished; {str(error).splitlines()[0]})"
        ) from None
    if "protocol" in verdicts:
        raise ConfigError(
            f"--join {address}: refused: the run there speaks another version of the shards' protocol than this "
            f"worker ({MAGIC:g}): join with the paratrain version the run runs"
        )
    if any(verdict != "ok" for verdict in verdicts):
        raise ConfigError(f"--join {address}: {REFUSED}; the one given is not it")
