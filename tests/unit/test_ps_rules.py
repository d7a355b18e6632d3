"""Parameter-server pieces that need no processes: shard layout and update rules."""

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.policies import AsyncRule, Gradient, StalePolicy, SyncRule
from paratrain.strategies.ps.protocol.wire import decode_version, encode_version


class View:
    def __init__(self, version=0, workers=3, done=(), clocks=None):
        self.version = version
        self.workers = workers
        self.done = set(done)
        self._clocks = clocks or dict.fromkeys(range(workers), 0)

    def active_workers(self):
        return set(range(self.workers)) - self.done

    def clocks(self):
        return self._clocks


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_layout_balances_bytes_and_covers_every_element_once(shards):
    shapes = [torch.Size([300, 7]), torch.Size([7]), torch.Size([10, 300]), torch.Size([10])]
    layout = ShardLayout(shapes, shards)
    sizes = [layout.shard_numel(s) for s in range(shards)]
    assert max(sizes) - min(sizes) <= 1
    covered = {i: torch.zeros(n, dtype=torch.int) for i, n in enumerate(layout.numels)}
    for shard in range(shards):
        offset = 0
        for piece in layout.pieces[shard]:
            assert piece.offset == offset
            covered[piece.index][piece.start : piece.stop] += 1
            offset += piece.numel
        assert offset == sizes[shard]
    assert all(bool((c == 1).all()) for c in covered.values())
    assert sum(layout.shard_bytes()) == 4 * layout.total


def test_more_shards_than_parameters_is_bad_input():
    with pytest.raises(ConfigError, match="--ps-shards 5 is more than the model's 3 parameters"):
        ShardLayout([torch.Size([3])], 5)


@pytest.mark.parametrize("version", [0, 1, 12345, 2**24 + 3, 2**40 + 17])
def test_versions_travel_exactly_in_float32(version):
    hi, lo = (torch.tensor(v, dtype=torch.float32).item() for v in encode_version(version))
    assert decode_version(hi, lo) == version


def test_sync_rule_holds_until_n_and_drops_late_gradients():
    rule = SyncRule(required=2)  # 2 gradients per version, a third worker is the backup
    view = View(version=4)
    assert rule.accept(Gradient(0, 4, 32, 1.0), view) == "hold"
    assert not rule.ready({0}, view)
    assert rule.ready({0, 2}, view)
    view.version = 5
    assert rule.accept(Gradient(2, 4, 32, 1.0), view) == "drop"  # computed on 4, 5 is out
    assert rule.may_pull(0, 5, view) and not rule.may_pull(0, 6, view)
    assert rule.wanted_after(Gradient(0, 4, 32, 1.0)) == 5


def test_sync_rule_makes_do_with_the_workers_left():
    rule = SyncRule(required=3)
    assert not rule.ready({0, 2}, View(workers=3))
    assert rule.ready({0, 2}, View(workers=3, done={1}))
    assert not rule.ready(set(), View(workers=3, done={0, 1, 2}))


def test_a_worker_done_after_its_push_does_not_close_the_round_early():
    # Worker 1 pushed its last gradient and said done; worker 0's is still on its way.
    assert not SyncRule(required=2).ready({1}, View(workers=2, done={1}))


def test_async_rule_applies_at_once_with_stale_policies():
    view = View(version=10)
    grad = Gradient(1, 6, 32, 1.0)  # staleness 4
    assert AsyncRule(StalePolicy("none")).accept(grad, view) == "apply" and grad.lr_scale == 1.0
    assert AsyncRule(StalePolicy("scale-lr")).accept(grad, view) == "apply" and grad.lr_scale == 0.25
    assert AsyncRule(StalePolicy("drop", max_staleness=3)).accept(Gradient(1, 6, 32, 1.0), view) == "drop"
    assert AsyncRule(StalePolicy("drop", max_staleness=4)).accept(Gradient(1, 6, 32, 1.0), view) == "apply"
    fresh = Gradient(1, 10, 32, 1.0)
    assert AsyncRule(StalePolicy("scale-lr")).accept(fresh, view) == "apply" and fresh.lr_scale == 1.0


def test_staleness_bound_holds_back_the_fastest_worker():
    rule = AsyncRule(StalePolicy(), staleness_bound=2)
    view = View(clocks={0: 5, 1: 3, 2: 4})
    assert rule.may_pull(0, 0, view)  # 5 - 3 = 2 <= 2
    view._clocks[0] = 6
    assert not rule.may_pull(0, 0, view)  # 3 ahead of worker 1
    view.done.add(1)  # a finished worker no longer holds anyone back
    assert rule.may_pull(0, 0, view)


def test_warmup_lets_worker_zero_train_alone():
    rule = AsyncRule(StalePolicy(), warmup_steps=20)
    assert rule.may_pull(0, 0, View(version=3))
    assert not rule.may_pull(1, 0, View(version=19))
    assert rule.may_pull(1, 0, View(version=20))
    assert rule.may_pull(1, 0, View(version=7, done={0}))  # worker 0 finished first: the others go on


def test_a_staleness_bound_under_warmup_starts_the_others_level_with_worker_zero():
    """--warmup-steps 6 --staleness-bound 2: worker 0 takes its 6 steps alone (the waiting
    workers, at clock 0, do not hold it back), then the others start level with it, and the
    bound holds from there."""
    rule = AsyncRule(StalePolicy(), staleness_bound=2, warmup_steps=6)
    view = View(clocks={0: 0, 1: 0, 2: 0})
    for step in range(6):
        view.version = step
        assert rule.may_pull(0, 0, view) and not rule.may_pull(1, 0, view), step
        view._clocks[0] += 1
    view.version = 6
    assert all(rule.may_pull(w, 0, view) for w in range(3))  # level: 6, 0 + 6, 0 + 6
    view._clocks.update({0: 9, 1: 1, 2: 3})  # 9 against 7: 2 ahead, at the bound
    assert rule.may_pull(0, 0, view) and rule.may_pull(2, 0, view)
    view._clocks[0] = 10
    assert not rule.may_pull(0, 0, view) and rule.may_pull(1, 0, view)
