"""A kill drill's seed: printed by the drill, repeated through PARATRAIN_DRILL_SEED."""

import pytest

from paratrain.drills import SEED_VARIABLE, drill_seed


def test_the_variable_repeats_a_drill_s_seed(monkeypatch):
    monkeypatch.setenv(SEED_VARIABLE, "915915")
    assert drill_seed() == 915915


def test_without_the_variable_each_drill_draws_a_fresh_seed(monkeypatch):
    monkeypatch.delenv(SEED_VARIABLE, raising=False)
    assert len({drill_seed() for _ in range(5)}) > 1


def test_a_seed_that_is_not_a_number_is_one_line(monkeypatch):
    monkeypatch.setenv(SEED_VARIABLE, "seed-7")
    with pytest.raises(SystemExit, match="PARATRAIN_DRILL_SEED='seed-7': expected the integer seed"):
        drill_seed()
