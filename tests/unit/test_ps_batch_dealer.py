"""Shard 0's dealer of each epoch's batches, resumed from a checkpoint."""

from paratrain.strategies.ps.protocol.batch_dealer import BatchDealer
from paratrain.strategies.ps.protocol.wire import NO_MORE_BATCHES


def _saved(next_batch, num_batches):
    dealer = BatchDealer(deals=True)
    dealer.load_state_dict({"next_batch": next_batch, "num_batches": num_batches})
    return dealer


def test_an_epoch_left_open_takes_the_resumed_runs_count_and_goes_on_where_it_stood():
    """Epoch 1 of 44 batches (2 workers' whole rounds) left after 16: a run of 3 workers
    counts 42, and is handed batches 16 to 41."""
    dealer = _saved({"0": 44, "1": 16}, {"0": 44, "1": 44})
    assert dealer.first_open_epoch() == 1
    assert dealer.num_batches == {0: 44}  # the open epoch's count is the resumed run's to say
    handed = [dealer.deal((1, 42)) for _ in range(27)]
    assert handed == [*range(16, 42), NO_MORE_BATCHES]
    assert dealer.num_batches == {0: 44, 1: 42}


def test_an_epoch_handed_out_whole_keeps_its_count_and_the_next_one_is_open():
    dealer = _saved({"0": 44, "1": 44}, {"0": 44, "1": 44})
    assert dealer.first_open_epoch() == 2 and dealer.num_batches == {0: 44, 1: 44}
    assert _saved({}, {}).first_open_epoch() == 0
