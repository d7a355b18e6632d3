import pytest

from paratrain.config import TrainConfig
from paratrain.train.schedules import Constant, ExponentialDecay, LinearScalingWarmup


def test_exponential_decay_staircase_and_smooth():
    stair = ExponentialDecay(0.1, decay_steps=100, decay_rate=0.1, staircase=True)
    assert [stair(s) for s in (0, 99, 100, 250)] == pytest.approx([0.1, 0.1, 0.01, 0.001])
    smooth = ExponentialDecay(0.1, decay_steps=100, decay_rate=0.1, staircase=False)
    assert smooth(50) == pytest.approx(0.1 * 0.1**0.5)


def test_linear_scaling_with_gradual_warmup():
    # Goyal et al.: 0.1 per 256 examples; a global batch of 1024 ends at 0.4.
    schedule = LinearScalingWarmup(0.1, global_batch=1024, reference_batch=256, warmup_steps=100)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(50) == pytest.approx(0.25)
    assert schedule(100) == schedule(10_000) == pytest.approx(0.4)


def test_schedules_from_config():
    config = TrainConfig(strategy="allreduce", workers=4, batch_size=64, lr=0.1, warmup_epochs=2)
    schedule = LinearScalingWarmup.from_config(config, steps_per_epoch=10)
    assert schedule.warmup_steps == 20 and schedule(20) == pytest.approx(0.1)
    assert Constant.from_config(config, 10)(123) == 0.1
