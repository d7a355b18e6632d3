"""A worker that announces a message to a parameter-server shard and dies before the shard
takes it. Gloo keeps that announcement: every receive from any rank on the message tag is
offered to the dead worker's link first and fails there, so the shard can no longer post
one. The shard goes on serving the others over their own links (protocol/receiving.py)
and the run ends as if the worker had never sent it.

Three processes over real Gloo: the shard (rank 0), the chief (worker 0) and a worker
(worker 1) that sends and exits before the shard begins to serve."""

import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.distributed

RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch import nn
    from paratrain.comm.codec_config import make_codec
    from paratrain.comm.packing import PackedGradient
    from paratrain.strategies.ps.heartbeat import heartbeat
    from paratrain.strategies.ps.layout import ShardLayout
    from paratrain.strategies.ps.modes import MODES, PSConfig, PSMode
    from paratrain.strategies.ps.protocol.client import ShardClient
    from paratrain.strategies.ps.protocol.links import WorldLink
    from paratrain.strategies.ps.protocol.server import ShardServer
    from paratrain.strategies.ps.protocol.wire import DONE, PULL, PUSH, SHUTDOWN, TAG_MESSAGE, Header

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    if rank == 0:  # the shard: it begins to serve once worker 1 is gone
        rule = MODES[PSMode.ASYNC].make_rule(PSConfig(), 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        server = ShardServer(0, 1, 2, model, optimizer, rule, store=store, heartbeat_timeout=2.0,
                             tolerate_loss=True, wait_timeout=30.0)
        store.wait(["gone"])
        time.sleep(1.0)  # its link's end has been read
        try:
            print("stats", json.dumps(server.serve()), flush=True)
        except Exception as error:
            print("failed", error, flush=True)
    elif rank == 2:  # worker 1: announces a message, and dies
        dist.isend(torch.zeros(64, dtype=torch.uint8), dst=0, tag=TAG_MESSAGE)
        time.sleep(0.5)
        store.set("gone", "1")
    else:  # worker 0, the chief: a pull, three pushes of ones, done, and the word to stop
        beats = heartbeat(store, 0, 2.0).start()
        store.wait(["gone"])
        time.sleep(1.0)
        layout = ShardLayout.of(model, 1)
        packers = [PackedGradient(make_codec("none"), lambda: make_codec("none"), layout.piece_shapes(0))]
        pulled = torch.zeros(layout.total)
        client = ShardClient(0, [WorldLink(0)], layout, packers, pulled, tags=0, store=store,
                             backup_workers=0, timeout=30.0)
        client.post_reply()
        client.send(Header(PULL, wants_reply=True))
        first = pulled.clone() if client.await_reply() else None
        for _ in range(3):
            client.post_reply()
            client.send(Header(PUSH, samples=8, wants_reply=True), torch.ones_like(pulled))
            client.await_reply()
        client.send(Header(DONE))
        client.drain()
        store.wait(["stats/0"])
        client.send(Header(SHUTDOWN))
        client.drain()
        beats.stop()
        print("moved", float((first - pulled).min()), float((first - pulled).max()), client.versions, flush=True)
    os._exit(0)
    """
)


def test_a_worker_dead_with_a_message_announced_leaves_the_shard_serving_the_others():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(store.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        outputs = [process.communicate(timeout=90) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    shard, chief = outputs[0][0].split(maxsplit=1), outputs[1][0].split(maxsplit=1)
    assert shard[0] == "stats", outputs[0][0] + outputs[0][1][-2000:]
    assert all(process.returncode == 0 for process in ranks), [err[-2000:] for _, err in outputs]
    assert '"workers_lost": [1]' in shard[1] and '"version": 3' in shard[1]
    # three SGD steps at lr 0.1 on gradients of ones: every parameter 0.3 lower
    low, high, versions = chief[1].split(maxsplit=2)
    assert abs(float(low) - 0.3) < 1e-6 and abs(float(high) - 0.3) < 1e-6
    assert versions.strip() == "[3]"
