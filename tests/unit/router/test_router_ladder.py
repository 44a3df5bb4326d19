"""The overload ladder: busyness from heartbeats, one rung per observation, hysteresis of 7 points."""

import pytest
from router_fakes import MODEL, decode_worker

from services.router.ladder import FleetReading, Ladder, read_fleet

INTERVAL_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def busy(share: float) -> FleetReading:
    return FleetReading(kv_occupancy=share)


def ladder_at(clock: Clock) -> Ladder:
    return Ladder(INTERVAL_S, clock=clock)


def observe_each_interval(ladder: Ladder, clock: Clock, *shares: float) -> list[int]:
    rungs = []
    for share in shares:
        assert ladder.observe(busy(share))
        rungs.append(ladder.rung)
        clock.now_s += INTERVAL_S
    return rungs


def test_a_jump_to_full_busyness_climbs_one_rung_per_observation():
    clock = Clock()
    ladder = ladder_at(clock)
    assert observe_each_interval(ladder, clock, 1.0, 1.0, 1.0, 1.0) == [1, 2, 3, 3]


def test_it_climbs_at_85_92_and_97_percent():
    clock = Clock()
    ladder = ladder_at(clock)
    assert observe_each_interval(ladder, clock, 0.84, 0.85, 0.91, 0.92, 0.96, 0.97) == [0, 1, 1, 2, 2, 3]


def test_it_comes_down_only_7_points_below_the_line_it_went_up_at():
    clock = Clock()
    ladder = ladder_at(clock)
    observe_each_interval(ladder, clock, 1.0, 1.0, 1.0)
    # Up at 97 %: stays at 3 down to 91 %, steps to 2 at 90 %; up at 92 %: down to 1 at 85 %.
    assert observe_each_interval(ladder, clock, 0.91, 0.90, 0.86, 0.85, 0.79, 0.78) == [3, 2, 2, 1, 1, 0]


def test_a_drop_to_idle_comes_down_one_rung_per_observation():
    clock = Clock()
    ladder = ladder_at(clock)
    observe_each_interval(ladder, clock, 1.0, 1.0, 1.0)
    assert observe_each_interval(ladder, clock, 0.0, 0.0, 0.0, 0.0) == [2, 1, 0, 0]


def test_an_observation_before_the_interval_has_passed_moves_nothing():
    clock = Clock()
    ladder = ladder_at(clock)
    assert ladder.observe(busy(1.0)) and ladder.rung == 1
    assert ladder.seconds_until_due() == pytest.approx(INTERVAL_S)
    clock.now_s += INTERVAL_S / 2
    assert not ladder.observe(busy(1.0))
    assert ladder.rung == 1
    assert ladder.seconds_until_due() == pytest.approx(INTERVAL_S / 2)
    clock.now_s += INTERVAL_S / 2
    assert ladder.seconds_until_due() == 0
    assert ladder.observe(busy(1.0)) and ladder.rung == 2


def test_busyness_is_the_max_of_kv_occupancy_and_the_mean_queue_pressure_of_the_large_models_pool():
    workers = [
        decode_worker("a", kv_blocks_free=10, kv_blocks_total=100, estimated_wait_s=1.0),
        decode_worker("b", kv_blocks_free=30, kv_blocks_total=100, estimated_wait_s=9.0),  # capped at 1
        decode_worker("other", model="small", kv_blocks_free=0, kv_blocks_total=100, estimated_wait_s=9.0),
        decode_worker("starting", is_ready=False, kv_blocks_free=0, kv_blocks_total=100),
    ]
    reading = read_fleet(workers, MODEL, free_target_s=2.0)
    assert reading.kv_occupancy == pytest.approx(0.8)
    assert reading.queue_pressure == pytest.approx((0.5 + 1.0) / 2)
    assert reading.busyness == pytest.approx(0.8)
    waiting = read_fleet([decode_worker("a", kv_blocks_total=100, kv_blocks_free=100, estimated_wait_s=1.9)], MODEL, 2.0)
    assert waiting.busyness == pytest.approx(0.95)


def test_queue_pressure_takes_each_workers_stated_target():
    workers = [
        decode_worker("cpu", kv_blocks_total=100, kv_blocks_free=100, estimated_wait_s=10.0, free_ttft_target_s=20.0),
        decode_worker("gpu", kv_blocks_total=100, kv_blocks_free=100, estimated_wait_s=1.0, free_ttft_target_s=2.0),
    ]
    assert read_fleet(workers, MODEL, free_target_s=2.0).queue_pressure == pytest.approx(0.5)


def test_an_empty_pool_is_not_busy():
    assert read_fleet([], MODEL, 2.0).busyness == 0
    assert read_fleet([decode_worker("a")], MODEL, 2.0).busyness == 0  # no KV reported yet
