"""A front's own refusals while its engine refuses (service/process/throttle.py), on a simulated clock: an engine
that accepts at most CAPACITY calls a second, offered four times that."""

from __future__ import annotations

import random

import pytest

from service.process.throttle import TAU_S, K, Throttle

CAPACITY = 200  # calls a second the simulated engine accepts


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def offer(throttle: Throttle, clock: Clock, rate: float, seconds: float, capacity: float) -> tuple[int, int, int]:
    """`rate` calls a second for `seconds`: (offered, sent to the engine, accepted by it), the engine accepting at
    most `capacity` a second (what it accepted in the last second, counted per call)."""
    offered = sent = accepted = 0
    recent: list[float] = []  # when the engine accepted, within the last second
    for _ in range(int(rate * seconds)):
        clock.now += 1.0 / rate
        offered += 1
        if throttle.refuse():
            continue
        sent += 1
        recent = [t for t in recent if t > clock.now - 1.0]
        ok = len(recent) < capacity
        if ok:
            recent.append(clock.now)
            accepted += 1
        throttle.answered(ok)
    return offered, sent, accepted


@pytest.fixture
def throttled():
    clock = Clock()
    return Throttle(clock, random.Random(7).random), clock


def test_an_engine_that_accepts_everything_is_sent_everything(throttled):
    throttle, clock = throttled
    assert offer(throttle, clock, 3 * CAPACITY, 5.0, capacity=10 * CAPACITY) == (3000, 3000, 3000)
    assert throttle.share() == 0.0


def test_at_four_times_what_the_engine_accepts_the_front_refuses_the_rest_itself(throttled):
    throttle, clock = throttled
    offer(throttle, clock, 4 * CAPACITY, 3.0, CAPACITY)  # the onset
    offered, sent, accepted = offer(throttle, clock, 4 * CAPACITY, 5.0, CAPACITY)
    assert accepted >= 0.9 * 5 * CAPACITY  # the engine still answers (near) all it can ...
    assert sent <= 1.2 * K * accepted  # ... and sees about K calls per answer, not four
    assert sent < 0.6 * offered
    assert 0.5 < throttle.share() < 0.75  # (1 - K / 4 = 0.625 in the limit)


def test_the_front_stops_refusing_once_the_engine_accepts_again_and_after_a_pause(throttled):
    throttle, clock = throttled
    offer(throttle, clock, 4 * CAPACITY, 5.0, CAPACITY)
    assert throttle.share() > 0.5
    offer(throttle, clock, 4 * CAPACITY, 8 * TAU_S, capacity=10 * CAPACITY)  # the engine has room again
    assert throttle.share() < 0.02
    offer(throttle, clock, 4 * CAPACITY, 5.0, CAPACITY)
    clock.now += 20 * TAU_S  # idle: a later call starts afresh
    assert throttle.share() < 1e-4 and not throttle.refuse()


def test_calls_an_absent_engine_never_answered_do_not_make_the_front_refuse(throttled):
    """An engine process restarting answers nothing for a while: once it is back, its calls are not refused."""
    throttle, clock = throttled
    for _ in range(2000):
        clock.now += 0.001
        assert not throttle.refuse()  # sent, and never answered
    assert throttle.share() == 0.0
    assert offer(throttle, clock, 4 * CAPACITY, 1.0, capacity=10 * CAPACITY)[1] == 4 * CAPACITY


def test_a_burst_of_calls_sent_together_is_not_refused_while_none_has_been_answered(throttled):
    """32 calls sent at once, before the first answer: calls in flight say nothing of the engine's acceptance."""
    throttle, clock = throttled
    assert not any(throttle.refuse() for _ in range(32))
    for _ in range(32):
        throttle.answered(True)
    clock.now += 0.01
    assert not any(throttle.refuse() for _ in range(32))


def test_refusing_says_whether_any_share_is_refused_without_decaying(throttled):
    throttle, clock = throttled
    assert not throttle.refusing()
    offer(throttle, clock, 4 * CAPACITY, 3.0, CAPACITY)
    assert throttle.refusing() and throttle.share() > 0
    offer(throttle, clock, 4 * CAPACITY, 8 * TAU_S, capacity=10 * CAPACITY)
    clock.now += 3 * TAU_S
    assert throttle.refusing() == (throttle.share() > 0)
