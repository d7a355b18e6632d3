"""A warm spare (session/standby.py): it warms up, waits for its assignment in a store, and
takes the variables of the replica it replaces; a malformed assignment is one clear error."""

import json
import os
import threading

import pytest

from paratrain.comm.transport import host_store
from paratrain.errors import ConfigError
from paratrain.session.incarnation import INCARNATION_ENV, restart_count
from paratrain.session.standby import STANDBY_ENV, assignment, take_assignment


def test_a_standby_warms_up_then_becomes_the_replica_its_assignment_names(monkeypatch):
    store = host_store(30)
    monkeypatch.setenv(STANDBY_ENV, f"127.0.0.1:{store.port}/standby-0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    order = []
    variables = {"REPLICA_GROUP_ID": "1", INCARNATION_ENV: "2", "PARATRAIN_REPLICA_STORE": "198.18.0.254:4000"}

    def assign():
        order.append("assigned")
        store.set("standby-0", json.dumps(variables))

    for name in variables:  # set here, so that monkeypatch puts each back as it was
        monkeypatch.setenv(name, "")
    timer = threading.Timer(0.3, assign)
    timer.start()
    try:
        take_assignment(lambda: order.append("warmed"))
    finally:
        timer.cancel()
    assert order == ["warmed", "assigned"]
    assert os.environ["REPLICA_GROUP_ID"] == "1" and restart_count() == 2
    assert os.environ["PARATRAIN_REPLICA_STORE"] == "198.18.0.254:4000"
    assert STANDBY_ENV not in os.environ  # its own processes' children are no standbys


def test_without_the_variable_a_process_is_no_standby(monkeypatch):
    monkeypatch.delenv(STANDBY_ENV, raising=False)
    called = []
    take_assignment(lambda: called.append(1))
    assert called == []


@pytest.mark.parametrize("value", ["1 2", "[1]", '{"REPLICA_GROUP_ID": 1}', '{"REPLICA_GROUP_ID": "x"}', "{}"])
def test_a_malformed_assignment_is_one_line_naming_the_form(value):
    with pytest.raises(ConfigError, match="must be a JSON object of strings with REPLICA_GROUP_ID"):
        assignment(value)
