"""``engine.tput_timer`` (``deepspeed.utils.timer.ThroughputTimer``) counts as DeepSpeed's does."""
import pytest

from shardspeed.utils.timer import ThroughputTimer


def _drive(timer, micro_steps, gas):
    for i in range(micro_steps):
        timer.start()
        timer.stop(global_step=(i + 1) % gas == 0, report_speed=False)
        if i == 4:
            timer.update_epoch_count()
    return timer.epoch_count, timer.micro_step_count, timer.global_step_count, timer.avg_samples_per_sec() > 0


def test_counts_equal_deepspeeds():
    timer_mod = pytest.importorskip("deepspeed.utils.timer")
    from types import SimpleNamespace
    ds = timer_mod.ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), batch_size=8, steps_per_output=None)
    ours = ThroughputTimer(batch_size=8)
    assert _drive(ours, 12, 2) == _drive(ds, 12, 2) == (1, 7, 6, True)
    assert ThroughputTimer(batch_size=8).avg_samples_per_sec() == float("-inf")
