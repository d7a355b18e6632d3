"""Tables on the parameter server, piece by piece: where rows live, what travels for them
(and what a shard refuses), how a shard steps them, and how rows are made."""

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.tables import RowInit, TableSpec, find_tables, materialize
from paratrain.strategies.ps.policies import StalePolicy
from paratrain.strategies.ps.protocol.wire import Malformed
from paratrain.strategies.ps.tables import sections
from paratrain.strategies.ps.tables.layout import TableLayout
from paratrain.strategies.ps.tables.optimizers import RowOptimizer, table_kind


@pytest.mark.parametrize("sharding", ["mod", "range"])
@pytest.mark.parametrize("rows, shards", [(10, 3), (7, 7), (2, 3), (1000, 4)])
def test_every_row_lives_on_exactly_one_shard_and_is_found_there(sharding, rows, shards):
    layout = TableLayout([TableSpec("t", rows, 4)], shards, sharding)
    held = torch.cat([layout.global_ids(0, s) for s in range(shards)])
    assert sorted(held.tolist()) == list(range(rows))
    assert sum(layout.rows_on(0, s) for s in range(shards)) == rows
    shard, local = layout.locate(0, torch.arange(rows))
    for s in range(shards):
        assert torch.equal(layout.global_ids(0, s, local[shard == s]), torch.arange(rows)[shard == s])
        assert all(0 <= x < layout.rows_on(0, s) for x in local[shard == s].tolist())


def test_mod_sharding_spreads_the_hot_rows_of_a_zipf_law():
    layout = TableLayout([TableSpec("t", 10_000, 4)], 4, "mod")
    shard, _ = layout.locate(0, torch.arange(100))  # the hundred hottest ids
    assert torch.bincount(shard).tolist() == [25, 25, 25, 25]


def _push(rows_on=(5, 3), dims=(2, 4)):
    ids = [torch.tensor([4, 0]), torch.tensor([2])]
    clocks = [torch.tensor([1, 0]), torch.tensor([3])]
    grads = [torch.randn(2, dims[0]), torch.randn(1, dims[1])]
    return sections.pack_push(ids, clocks, grads), ids, clocks, grads


def test_a_push_section_reads_back_what_was_packed():
    section, ids, clocks, grads = _push()
    now = [torch.tensor([0, 0, 0, 0, 5]), torch.tensor([0, 0, 3])]
    got = sections.read_push(section, [5, 3], [2, 4], now)
    for a, b in zip(got.ids + got.clocks + got.grads, ids + clocks + grads):
        assert torch.equal(a, b)
    assert section.numel() <= sections.push_bound([5, 3], [2, 4])
    request = sections.pack_request(ids)
    assert [t.tolist() for t in sections.read_request(request, [5, 3])] == [[4, 0], [2]]


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s: s[:-4], "length does not match"),
        (lambda s: torch.cat([s, torch.zeros(4, dtype=torch.uint8)]), "length does not match"),
        (lambda s: s[:4], "cut short"),
        (lambda s: _set_long(s, 0, 6), "more rows than the shard holds"),
        (lambda s: _set_long(s, 0, -1), "more rows than the shard holds"),
        (lambda s: _set_long(s, 2, 5), "out of the shard's range"),
        (lambda s: _set_long(s, 3, 4), "asked for twice"),
        (lambda s: _set_long(s, 5, 2), "a row clock the shard has not reached"),
        (lambda s: _set_float(s, 0, float("nan")), "not finite"),
    ],
)
def test_a_shard_refuses_a_section_out_of_its_range(change, reason):
    section, *_ = _push()
    now = [torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0, 0, 3])]
    with pytest.raises(Malformed, match=reason):
        sections.read_push(change(section.clone()), [5, 3], [2, 4], now)


def _set_long(section, index, value):
    section[: 8 * (index + 1)].view(torch.int64)[index] = value
    return section


def _set_float(section, index, value):
    head = 8 * (2 + 2 * 3)
    section[head:].view(torch.float32)[index] = value
    return section


def test_a_request_for_rows_twice_or_past_the_shard_is_refused():
    with pytest.raises(Malformed, match="twice"):
        sections.read_request(sections.pack_request([torch.tensor([1, 1]), torch.tensor([], dtype=torch.long)]), [5, 3])
    with pytest.raises(Malformed, match="range"):
        sections.read_request(sections.pack_request([torch.tensor([5]), torch.tensor([], dtype=torch.long)]), [5, 3])


def _lazy_beside(kind, reference, rows, dim, steps, sparse):
    """A table stepped by RowOptimizer ``kind`` and the same table as one parameter stepped by
    the ``reference`` optimizer on the same gradients (a sparse or a dense one), ``steps``
    giving each step's row ids: (initial, lazy rows, reference rows)."""
    torch.manual_seed(0)
    weight = torch.randn(rows, dim)
    param = nn.Parameter(weight.clone())
    optimizer = reference([param])
    table = weight.clone()
    lazy = RowOptimizer(kind, optimizer.param_groups[0], table)
    for ids in map(torch.tensor, steps):
        grad = torch.randn(len(ids), dim)
        if sparse:
            param.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, (rows, dim))
        else:
            param.grad = torch.zeros(rows, dim).index_add_(0, ids, grad)
        optimizer.step()
        lazy.step(ids, grad, 1.0)
    return weight, table, param.detach()


def test_lazy_sgd_moves_touched_rows_as_dense_sgd_and_no_other():
    weight, rows, dense = _lazy_beside("sgd", lambda p: torch.optim.SGD(p, lr=0.1), 6, 3, [[0, 4]] * 3, False)
    assert torch.allclose(rows, dense, atol=1e-7)
    assert torch.equal(rows[[1, 2, 3, 5]], weight[[1, 2, 3, 5]])


def test_lazy_adam_is_torch_sparse_adam():
    """lazy-adam steps what torch.optim.SparseAdam (TensorFlow's LazyAdam) steps, each row
    once a step as a shard steps them."""
    steps = [[step, 3, 7] for step in (0, 1, 2, 4, 1)]
    weight, rows, sparse = _lazy_beside("lazy-adam", lambda p: torch.optim.SparseAdam(p, lr=0.01), 8, 4, steps, True)
    assert torch.allclose(rows, sparse, atol=1e-6)
    assert torch.equal(rows[[5, 6]], weight[[5, 6]])  # never touched
    assert not torch.equal(rows[0], weight[0])


def test_row_wise_adagrad_keeps_one_accumulator_per_row():
    rows = torch.ones(3, 2)
    opt = RowOptimizer("adagrad", {"lr": 0.5, "eps": 0.0}, rows)
    opt.step(torch.tensor([1]), torch.tensor([[3.0, 1.0]]), 1.0)
    assert opt.state["sum"].tolist() == [0.0, 5.0, 0.0]  # mean of the squares
    assert torch.allclose(rows[1], torch.tensor([1 - 0.5 * 3 / 5**0.5, 1 - 0.5 * 1 / 5**0.5]))
    assert rows[0].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy-adam"])
def test_adamws_decoupled_weight_decay_shrinks_the_touched_rows_under_every_kind(kind):
    """AdamW's weight decay (decoupled) with --table-optimizer of any kind: a touched row's
    weights are multiplied by 1 - lr wd before its step, an untouched row keeps them. With
    a zero gradient the step itself moves nothing (sgd, adagrad) or nothing yet (Adam's
    moments of a zero gradient are zero), so the decay is all that moves the row."""
    rows = torch.ones(3, 2)
    opt = RowOptimizer(kind, {"lr": 0.1, "weight_decay": 0.5}, rows, decoupled=True)
    opt.step(torch.tensor([1]), torch.zeros(1, 2), 1.0)
    assert torch.allclose(rows[1], torch.full((2,), 1 - 0.1 * 0.5))
    assert rows[0].tolist() == rows[2].tolist() == [1.0, 1.0]


def test_the_table_optimizer_follows_the_users_or_is_named():
    p = [nn.Parameter(torch.zeros(1))]
    assert table_kind(type(torch.optim.AdamW(p)).__name__, "auto") == "lazy-adam"
    assert table_kind(type(torch.optim.Adagrad(p)).__name__, "auto") == "adagrad"
    assert table_kind("adam", "auto") == "lazy-adam"  # an --optimizer name (the launcher's check)
    assert table_kind(type(torch.optim.RMSprop(p)).__name__, "sgd") == "sgd"
    with pytest.raises(ConfigError, match="RMSprop has no lazy form: give --table-optimizer"):
        table_kind(type(torch.optim.RMSprop(p)).__name__, "auto")


def test_a_row_is_the_same_whoever_makes_it_and_materialize_makes_them_all():
    init = RowInit(seed=7, dim=3, scale=0.1)
    ids = torch.tensor([9000, 5, 4096, 4095])
    together = init(ids)
    alone = torch.cat([init(ids[i : i + 1]) for i in range(len(ids))])
    assert torch.equal(together, alone)
    assert together.abs().max() <= 0.1
    table = nn.EmbeddingBag(10_000, 3, device="meta")
    table.init_rows = init
    model = materialize(nn.Sequential(table))
    assert torch.equal(model[0].weight.detach()[ids], together)


def test_tables_are_found_by_name_or_all_and_tied_weights_stay_dense():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.words = nn.Embedding(10, 4)
            self.places = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.words.weight

    model = Tied()
    assert [name for name, _ in find_tables(model, "all")] == ["places"]
    with pytest.raises(ConfigError, match="tied to another module"):
        find_tables(model, "words")
    with pytest.raises(ConfigError, match="the model has words, places"):
        find_tables(model, "out")
    with pytest.raises(ConfigError, match="max_norm"):
        find_tables(nn.Sequential(nn.Embedding(3, 2, max_norm=1.0)), "0")


def test_a_row_id_out_of_a_tables_range_is_one_line_naming_the_table():
    from paratrain.strategies.ps.tables.remote import RemoteTable

    table = RemoteTable(0, TableSpec("tables.0", 10, 2), rows=None)
    with pytest.raises(ConfigError, match=r"table tables.0: row id 10 is out of its range 0..9"):
        table(torch.tensor([[3, 10]]))
    with pytest.raises(ConfigError, match=r"row id -1 is out of its range"):
        table(torch.tensor([-1]))


def _shard(rows=6, dim=2, lr=1.0):
    from paratrain.strategies.ps.tables.shard import TableShard

    torch.manual_seed(0)
    table = nn.Embedding(rows, dim)
    layout = TableLayout([TableSpec("t", rows, dim)], 1)
    return TableShard(layout, 0, [table], [{"lr": lr}], "sgd", False), table.weight.detach().clone()


def _rows(ids, clocks, grads):
    from paratrain.strategies.ps.tables.sections import RowGrads

    return RowGrads([torch.tensor(ids)], [torch.tensor(clocks)], [torch.tensor(grads, dtype=torch.float32)])


@pytest.mark.parametrize(
    "policy, moved",
    [
        (StalePolicy("none"), {0: 1.0, 1: 1.0, 2: 1.0}),
        (StalePolicy("scale-lr"), {0: 1.0, 1: 1.0, 2: 0.5}),  # staleness 0 and 1 step whole, 2 by half
        (StalePolicy("drop", max_staleness=1), {0: 1.0, 1: 1.0, 2: 0.0}),  # staler than 1: left out
    ],
)
def test_ps_async_judges_each_row_by_its_own_staleness(policy, moved):
    """Row 2 was updated twice since the push's pull, row 1 once, row 0 never: each row's
    step is scaled (or left out) by its own staleness, not the push's."""
    shard, start = _shard()
    shard.step_now(_rows([1, 2], [0, 0], [[0.0, 0.0], [0.0, 0.0]]), 1.0, None)  # clocks: row 1 -> 1, row 2 -> 1
    shard.step_now(_rows([2], [1], [[0.0, 0.0]]), 1.0, None)  # row 2 -> 2
    assert shard.clocks[0][:3].tolist() == [0, 1, 2]
    before = shard.rows[0].clone()
    shard.step_now(_rows([0, 1, 2], [0, 0, 0], [[1.0, 1.0]] * 3), 1.0, policy)
    for row, share in moved.items():
        assert torch.allclose(before[row] - shard.rows[0][row], torch.full((2,), share)), (row, shard.rows[0][row])
    assert shard.row_staleness[2] == 1 and shard.row_staleness[1] == 1
    assert shard.rows_dropped == (1 if policy.name == "drop" else 0)
    assert torch.equal(shard.rows[0][3:], start[3:])  # untouched rows never move


def test_a_synchronous_round_averages_its_rows_by_examples_and_a_skipped_round_moves_none():
    shard, start = _shard()
    shard.hold(_rows([0, 1], [0, 0], [[3.0, 3.0], [1.0, 1.0]]), samples=1)
    shard.hold(_rows([1], [0], [[4.0, 4.0]]), samples=3)
    shard.step_held(total=4, lr_scale=1.0)
    # row 0: 3 x 1/4; row 1: (1 x 1 + 4 x 3) / 4
    assert torch.allclose(start[0] - shard.rows[0][0], torch.full((2,), 0.75))
    assert torch.allclose(start[1] - shard.rows[0][1], torch.full((2,), 13 / 4))
    after = shard.rows[0].clone()
    shard.hold(_rows([0], [1], [[1.0, 1.0]]), samples=1)
    shard.drop_held()
    assert torch.equal(shard.rows[0], after) and shard.optimizers[0].steps == 1  # as the dense optimizer's


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy-adam"])
def test_scale_lr_divides_a_stale_rows_step_under_every_table_optimizer(kind):
    """``scale-lr`` divides the learning rate of a row s versions stale by s, as it divides
    the dense step's: under Adagrad and Adam, whose steps do not shrink with the gradient,
    too. Row 2 is 2 versions stale, row 0 fresh: row 2 moves half as far as it would under
    no policy, row 0 as far."""
    from paratrain.strategies.ps.tables.shard import TableShard

    moved = {}
    for policy in (StalePolicy("none"), StalePolicy("scale-lr")):
        torch.manual_seed(0)
        table = nn.Embedding(4, 2)
        shard = TableShard(TableLayout([TableSpec("t", 4, 2)], 1), 0, [table], [{"lr": 0.1}], kind, False)
        shard.clocks[0][2] = 2  # two updates since the push's pull
        before = shard.rows[0].clone()
        shard.step_now(_rows([0, 2], [0, 0], [[1.0, -2.0], [0.5, 3.0]]), 1.0, policy)
        moved[policy.name] = before - shard.rows[0]
    none, scaled = moved["none"], moved["scale-lr"]
    assert torch.allclose(scaled[0], none[0]) and none[0].abs().min() > 0
    assert torch.allclose(scaled[2], none[2] / 2), (scaled[2], none[2])


def test_a_shard_reads_its_rows_where_they_were_saved_and_refuses_other_tables():
    """The same rows on 2 shards by ``mod``, then by ``range``: each shard's saved part holds
    other rows than the shard now holds (so the run reshards them); a part whose run made
    other modules tables is refused, naming both."""
    from paratrain.strategies.ps.tables.shard import TableShard

    def shards(sharding, name="t"):
        torch.manual_seed(0)  # the same rows each time
        table = nn.Embedding(8, 2)
        layout = TableLayout([TableSpec(name, 8, 2)], 2, sharding)
        return [TableShard(layout, s, [table], [{"lr": 0.1}], "sgd", False) for s in range(2)]

    mod, by_range = shards("mod"), shards("range")
    saved = [shard.state_dict() for shard in mod]
    assert all(shard.holds_as_saved(part) for shard, part in zip(mod, saved))
    assert not any(shard.holds_as_saved(part) for shard, part in zip(by_range, saved))
    for shard in by_range:
        shard.rows[0].zero_()
    moved = by_range[1].resharded(saved)
    assert torch.equal(moved["rows"][0], shards("range")[1].rows[0])  # rows 4-7, from where they were saved
    with pytest.raises(ConfigError, match="the checkpoint's tables are t; this run's are u"):
        shards("mod", "u")[0].holds_as_saved(saved[0])
