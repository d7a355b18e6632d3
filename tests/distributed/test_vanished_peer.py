"""A member of the quorum that the Lighthouse no longer hears (strategies/fault_tolerant/peers.py),
read from a real Lighthouse: the heartbeat ages of its status page, and the verdict a
survivor's waiting collective acts on."""

import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft")
pytestmark = pytest.mark.distributed

from torchft._torchft import LighthouseClient, LighthouseServer  # noqa: E402

from paratrain.launch.replacing import _unheard  # noqa: E402
from paratrain.strategies.fault_tolerant.peers import PeerWatch, heartbeat_ages  # noqa: E402


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=1000)
    address = server.address().replace("http://", "").rpartition(":")[2]
    yield f"http://127.0.0.1:{address}", LighthouseClient(server.address(), timedelta(seconds=5))
    server.shutdown()


def test_the_ages_are_those_of_each_replica_s_last_heartbeat(lighthouse):
    url, client = lighthouse
    assert heartbeat_ages(url) == {}
    client.heartbeat("replica_0:a1b2")
    time.sleep(0.6)
    client.heartbeat("replica_1:c3d4")
    ages = heartbeat_ages(url)
    assert set(ages) == {"replica_0:a1b2", "replica_1:c3d4"}
    assert 0.6 <= ages["replica_0:a1b2"] < 5.0  # heard 0.6 s before the other
    assert 0.0 <= ages["replica_1:c3d4"] < ages["replica_0:a1b2"] - 0.5


def test_a_member_not_heard_for_the_heartbeat_timeout_is_lost_and_no_other(lighthouse):
    url, client = lighthouse
    peers = PeerWatch(url, heartbeat_timeout=0.5)
    peers.own_id = "replica_0:own"
    peers.members = ["replica_0:own", "replica_1:gone", "replica_2:alive", "replica_3:never"]
    client.heartbeat("replica_1:gone")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # the others beat; replica_1 has gone quiet
        client.heartbeat("replica_2:alive")
        time.sleep(0.1)
    # This replica's own id is never a loss (its beats are not needed), one never heard is.
    assert peers.lost() == ["replica_1:gone", "replica_3:never"]


def test_a_lighthouse_that_does_not_answer_gives_no_verdict():
    peers = PeerWatch("http://127.0.0.1:9", heartbeat_timeout=0.5)  # the discard port: nothing listens
    peers.members = ["replica_1:x"]
    assert peers.lost() == []


def test_the_launcher_stops_only_a_replica_behind_and_unheard(lighthouse):
    url, client = lighthouse
    client.heartbeat("replica_1:old")  # an earlier incarnation of replica 1, then silence
    time.sleep(0.7)
    client.heartbeat("replica_2:x")
    # Replica 0 finished at step 90; 1 is behind and unheard; 2 is behind but heard; 3 is
    # never heard (its Manager stopped) but at the last step: finishing, its results to come.
    assert _unheard(url, 0.5, [1, 2, 3], [90, 40, 88, 90]) == [1]
