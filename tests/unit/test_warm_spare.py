"""A warm spare (session/warm_spare.py): it warms up, waits for its assignment in a store, and
takes the variables of the replica it replaces; a malformed assignment is one clear error."""

import json
import os
import threading

import pytest

from paratrain.comm.transport import host_store
from paratrain.errors import ConfigError
from paratrain.session.incarnation import INCARNATION_ENV, restart_count
from paratrain.session.warm_spare import WARM_SPARE_ENV, replica_variables, take_replica_if_warm_spare


def test_a_warm_spare_warms_up_then_becomes_the_replica_its_assignment_names(monkeypatch):
    store = host_store(30)
    monkeypatch.setenv(WARM_SPARE_ENV, f"127.0.0.1:{store.port}/spare-0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    order = []
    warmed = threading.Event()
    variables = {"REPLICA_GROUP_ID": "1", INCARNATION_ENV: "2", "PARATRAIN_REPLICA_STORE": "198.18.0.254:4000"}

    def assign():  # as the runner does once a replica is lost: whenever that comes
        warmed.wait(30)  # a spare that waited before warming up never sets it: "assigned" comes first
        order.append("assigned")
        store.set("spare-0", json.dumps(variables))

    def warm_up():
        order.append("warmed")
        warmed.set()

    for name in variables:  # set here, so that monkeypatch puts each back as it was
        monkeypatch.setenv(name, "")
    runner = threading.Thread(target=assign, daemon=True)
    runner.start()
    take_replica_if_warm_spare(warm_up)
    runner.join(5)
    assert order == ["warmed", "assigned"]
    assert os.environ["REPLICA_GROUP_ID"] == "1" and restart_count() == 2
    assert os.environ["PARATRAIN_REPLICA_STORE"] == "198.18.0.254:4000"
    assert WARM_SPARE_ENV not in os.environ  # its own processes' children are no warm spares


def test_without_the_variable_a_process_is_no_warm_spare(monkeypatch):
    monkeypatch.delenv(WARM_SPARE_ENV, raising=False)
    called = []
    take_replica_if_warm_spare(lambda: called.append(1))
    assert called == []


@pytest.mark.parametrize("value", ["1 2", "[1]", '{"REPLICA_GROUP_ID": 1}', '{"REPLICA_GROUP_ID": "x"}', "{}"])
def test_a_malformed_assignment_is_one_line_naming_the_form(value):
    with pytest.raises(ConfigError, match="must be a JSON object of strings with REPLICA_GROUP_ID"):
        replica_variables(value)
