"""The join token of a parameter-server run: where it comes from, how a shard checks it, and
the one-line refusals of a joiner, over a real store on loopback."""

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from paratrain.errors import ConfigError
from paratrain.session.join_token import JOIN_TOKEN_ENV, proof, proves, read_join_token, save_join_token
from paratrain.strategies.ps.join_access import JoinAccess
from paratrain.strategies.ps.joining import RUN_KEY, JoinAdmitter, join_run
from paratrain.strategies.ps.modes import PSConfig
from paratrain.strategies.ps.protocol.wire import MAGIC

FACTS = {"strategy": "ps-async", "shards": 1, "compression": "none", "pull_compression": "none"}


def test_the_token_comes_from_its_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(JOIN_TOKEN_ENV, "from-env")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\nignored\n")
    assert read_join_token(str(token_file)) == "from-file"
    assert read_join_token(None) == "from-env"
    monkeypatch.delenv(JOIN_TOKEN_ENV)
    assert read_join_token(None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"--join-token-file .*empty is empty: it holds the run's join token"):
        read_join_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"--join-token-file .*missing: cannot read it \(No such file"):
        read_join_token(str(tmp_path / "missing"))


def test_a_saved_token_is_readable_by_its_owner_only(tmp_path):
    old = tmp_path / "t"
    old.write_text("old")
    old.chmod(0o644)
    path = save_join_token("secret", old)
    assert path.read_text() == "secret\n" and path.stat().st_mode & 0o777 == 0o600


def test_a_proof_holds_for_its_token_run_worker_shard_and_challenge_only():
    answer = proof("t", "run/", 3, 1, "c")
    assert proves("t", "run/", 3, 1, "c", answer)
    for other in [
        ("u", "run/", 3, 1, "c"),
        ("t", "run2/", 3, 1, "c"),
        ("t", "run/", 4, 1, "c"),
        ("t", "run/", 3, 0, "c"),
        ("t", "run/", 3, 1, "d"),
    ]:
        assert not proves(*other, answer)
    assert not proves("t", "run/", 3, 1, "c", "")


def test_joiners_are_admitted_with_a_token_unless_closed(monkeypatch):
    monkeypatch.setenv(JOIN_TOKEN_ENV, "s")
    assert JoinAccess.of(True, PSConfig()).key("run/") == ("s", "run/")
    assert JoinAccess.of(True, PSConfig(joiners=False)).key("run/") is None
    assert JoinAccess.of(False, PSConfig()).key("run/") is None  # ps-sync takes no joiners
    monkeypatch.delenv(JOIN_TOKEN_ENV)
    assert JoinAccess.of(True, PSConfig()).key("run/") is None  # no token: closed (torchrun without one)


def _run(store, joiners=True):
    run = {**FACTS, "prefix": "run/", "tags": 16, "workers": 2, "parameters": 10, "per_update": 1, "options": {}}
    store.set(RUN_KEY, json.dumps({**run, "joiners": joiners}))
    return dist.PrefixStore("run/", store)


def test_a_joiner_is_refused_in_one_line_by_a_closed_run_without_a_token_and_with_a_wrong_one():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{store.port}"
    _run(store, joiners=False)
    with pytest.raises(ConfigError, match=r"refused: the run there takes no joiners \(it runs with --no-joiners"):
        join_run(address, FACTS, 10.0, "anything")
    run_store = _run(store)
    with pytest.raises(ConfigError, match="refused: this run needs its join token .*; give it with --join-token-file"):
        join_run(address, FACTS, 10.0, None)
    assert not run_store.check(["join/0"])  # no ticket taken: nothing of the run moved
    finished = threading.Event()
    admitted = []
    admitter = JoinAdmitter(
        run_store, 0, finished, lambda worker, link: admitted.append(worker), 10.0, ("right", "run/")
    )
    admitter.start()
    try:
        with pytest.raises(ConfigError, match=r"refused: this run needs its join token .*; the one given is not it"):
            join_run(address, FACTS, 10.0, "wrong")
    finally:
        finished.set()
        admitter.thread.join(5)
    assert admitter.refused == 1 and admitted == []
    assert run_store.get("verdict/c0/0") == b"refused"
    assert run_store.add("joins", 0) == 0 and not run_store.check(["join/0"])  # no worker number taken


def _serve_until_refused(admitter, finished, refusals):
    """Run ``admitter`` until it has refused ``refusals`` joiners (5 s at most), then close it."""
    admitter.start()
    deadline = time.monotonic() + 5
    while admitter.refused < refusals and time.monotonic() < deadline:
        time.sleep(0.05)
    finished.set()
    admitter.thread.join(5)


def test_a_shard_admits_only_a_worker_number_taken_after_proving_the_token():
    """A process that takes a worker number without the handshake (as a joiner skipping
    it would) is refused; one that proved the token as a candidate first is admitted."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    run_store = _run(store)
    run_store.add("joins", 1)
    run_store.set("join/0", json.dumps({"worker": 2, "candidate": 7}))  # no such candidate proved
    finished, admitted = threading.Event(), []
    admitter = JoinAdmitter(
        run_store, 0, finished, lambda worker, link: admitted.append(worker), 10.0, ("right", "run/")
    )
    admitter._proven = lambda candidate: True  # the handshake itself is the test above's
    run_store.add("candidates", 1)
    run_store.set("candidate/0", json.dumps({"candidate": 0, "protocol": MAGIC}))
    _serve_until_refused(admitter, finished, 1)
    assert admitter.refused == 1 and admitted == []


def test_a_joiner_of_another_protocol_version_is_refused_before_any_challenge_or_link():
    """A Gloo link cannot refuse a message longer than the buffer posted for it (Gloo ends
    the receiving process), so the shard refuses a joiner of another protocol version before
    it has one: no challenge asked, no worker number, no link."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    run_store = _run(store)
    finished, admitted = threading.Event(), []
    admitter = JoinAdmitter(
        run_store, 0, finished, lambda worker, link: admitted.append(worker), 10.0, ("right", "run/")
    )
    run_store.add("candidates", 2)
    run_store.set("candidate/0", json.dumps({"candidate": 0}))  # an older joiner: no version said
    run_store.set("candidate/1", json.dumps({"candidate": 1, "protocol": MAGIC + 1}))
    _serve_until_refused(admitter, finished, 2)
    assert admitter.refused == 2 and admitted == []
    assert run_store.get("verdict/c0/0") == b"protocol" and run_store.get("verdict/c1/0") == b"protocol"
    assert not run_store.check(["challenge/c0/0"]) and not run_store.check(["challenge/c1/0"])
    assert run_store.add("joins", 0) == 0
