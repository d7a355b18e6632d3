"""What message validation costs a parameter-server shard, and what a join costs a joiner.

    python benchmarks/ps_screen.py [--steps 400] [--messages 3000] [--seed S]

1. The good path: a worker's steps (a push, then the reply) to one shard in one process
   over the protocol's in-memory link (protocol/memory.py) with the production wire and
   validator; and the validator alone on a good push (``Header.read`` and
   ``MessageValidator.check``).
2. Refusing: the shard's own work for bad messages (generated as
   tests/unit/test_ps_validator.py does, each from a joiner that the shard then drops), timed
   through the path a receive thread takes (``Receiving.validated``, the refusal, the drop),
   one message after another on one core. From it, the rate of bad messages that takes 10%
   of a shard's core: the fuzz rate at which a shard that trains on one core slows by at
   most 10%. (Sending them from the same process instead measures the sender: Python's
   one interpreter lock puts the generator's cost on the shard's threads.)
3. The join handshake: a shard's join admitter and a joiner over a real TCPStore on loopback, each
   with its own client, one challenge and one answer (session/join_token.py), over many joins.

Writes benchmarks/results/ps_screen.json and .md. Numbers are this machine's (2 cores).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

import test_ps_validator as fuzz  # noqa: E402  (the bad messages of the fuzz test)

from paratrain.strategies.ps.modes import PSMode  # noqa: E402
from paratrain.strategies.ps.protocol.wire import PULL, PUSH, Header  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _worker_steps(server, steps: int, stop_fire: threading.Event | None = None) -> float:
    """Seconds per step of worker 0: a push with a reply, on a fixed gradient."""
    client, _ = fuzz._client(server, 0)
    client.post_reply()
    client.send(Header(PULL, wants_reply=True))
    client.await_reply()
    grad = torch.randn(server.layout.total) * 1e-3
    started = time.perf_counter()
    for _ in range(steps):
        client.post_reply()
        client.send(Header(PUSH, samples=8, wants_reply=True), grad)
        client.await_reply()
    elapsed = time.perf_counter() - started
    if stop_fire is not None:
        stop_fire.set()
    return elapsed / steps


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def good_path(steps: int) -> dict:
    fuzz._model = _model  # a model of ~19k parameters, as a small slice of a real one
    per_step = min(_worker_steps(fuzz._server(PSMode.ASYNC), steps) for _ in range(3))
    server = fuzz._server(PSMode.ASYNC)
    server.workers.add(0)
    message = fuzz._message(server, Header(PUSH, samples=8))
    started, n = time.perf_counter(), 20000
    for _ in range(n):
        server.validator.check(server, 0, message)
    return {"seconds_per_step": per_step, "screen_seconds_per_message": (time.perf_counter() - started) / n}


def refusing(messages: int, seed: int) -> dict:
    """Seconds of the shard's work per bad message, along the receive thread's path."""
    rng = random.Random(seed)
    server = fuzz._server(PSMode.ASYNC)
    bad = []
    while len(bad) < messages:
        message, outcome = fuzz._bad(rng, server)
        if outcome != "skipped":  # a NaN payload from a member is a push the shard skips, not a refusal
            bad.append(
                torch.cat([message, torch.zeros(server.messages[0].numel() - message.numel(), dtype=torch.uint8)])
            )
    spent = 0.0
    for worker, message in enumerate(bad, start=1):
        # what admitting a joiner makes of it, without its receive thread (that thread's
        # wait would be timed too, on the same interpreter)
        server.workers.add(worker), server.joined.append(worker)
        server._clocks[worker], server.links[worker] = 0, None
        started = time.perf_counter()
        assert server.receiving.validated(worker, message) is None
        spent += time.perf_counter() - started
        # forgotten again, so that every message meets a shard of one worker and one joiner
        server.workers.discard(worker), server.lost.discard(worker), server.joined.remove(worker)
        server._clocks.pop(worker), server.links.pop(worker)
    per_message = spent / messages
    return {"messages": messages, "seconds_per_message": per_message, "refused": dict(server.validator.refused)}


def handshake(joins: int) -> dict:
    from paratrain.session.join_token import new_join_token
    from paratrain.strategies.ps.joining import JoinAdmitter, _prove

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    token, run = new_join_token(), "bench/"
    joiner = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    admitter = JoinAdmitter(
        store, 0, threading.Event(), None, 10.0, (token, run)
    )  # each side its own client, as across hosts
    times = []
    for candidate in range(joins):
        proving = threading.Thread(target=admitter._proven, args=(candidate,))
        started = time.perf_counter()
        proving.start()
        _prove(joiner, "127.0.0.1", {"shards": 1, "prefix": run}, f"c{candidate}", token, 10.0)
        times.append(time.perf_counter() - started)
        proving.join()
    times.sort()
    return {"joins": joins, "median_seconds": times[len(times) // 2], "max_seconds": times[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    args = parser.parse_args()
    print(f"seed {args.seed}", flush=True)
    good = good_path(args.steps)
    print(json.dumps(good), flush=True)
    refused = refusing(args.messages, args.seed)
    print(json.dumps(refused), flush=True)
    join = handshake(200)
    print(json.dumps(join), flush=True)
    result = {
        "seed": args.seed,
        "good_path": good,
        "refusing": refused,
        "fuzz_rate_at_10_percent_of_a_core": 0.10 / refused["seconds_per_message"],
        "join_handshake": join,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ps_screen.json").write_text(json.dumps(result, indent=1) + "\n")
    table = [
        "| what | time |",
        "| --- | ---: |",
        f"| a worker's step on the good path (push and reply, in-process link, 19k parameters) | "
        f"{good['seconds_per_step'] * 1e3:.2f} ms |",
        f"| the screen of one good push | {good['screen_seconds_per_message'] * 1e6:.1f} us |",
        f"| the shard's work for one bad message (screen, refusal, the joiner dropped) | "
        f"{refused['seconds_per_message'] * 1e6:.1f} us |",
        f"| the join handshake, one shard (median of {join['joins']}; max {join['max_seconds'] * 1e3:.2f} ms) | "
        f"{join['median_seconds'] * 1e3:.2f} ms |",
    ]
    summary = (
        f"A shard refuses {result['fuzz_rate_at_10_percent_of_a_core']:.0f} bad messages per second with 10% of one "
        f"core. Seed {args.seed}; {args.messages} bad messages of {len(refused['refused'])} reasons."
    )
    (RESULTS / "ps_screen.md").write_text("\n".join(table) + "\n\n" + summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
