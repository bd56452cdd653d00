"""A front's own refusals while its engine refuses (service/process/throttle.py), on a simulated clock: an engine
that accepts at most CAPACITY calls a second, offered four times that."""

from __future__ import annotations

import random

import pytest

from service.process.throttle import MIN_K, TAU_S, Throttle, send_ratio

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
    return Throttle(MIN_K, clock, random.Random(7).random), clock


def test_an_engine_that_accepts_everything_is_sent_everything(throttled):
    throttle, clock = throttled
    assert offer(throttle, clock, 3 * CAPACITY, 5.0, capacity=10 * CAPACITY) == (3000, 3000, 3000)
    assert throttle.share() == 0.0


def test_at_four_times_what_the_engine_accepts_the_front_refuses_the_rest_itself(throttled):
    throttle, clock = throttled
    offer(throttle, clock, 4 * CAPACITY, 3.0, CAPACITY)  # the onset
    offered, sent, accepted = offer(throttle, clock, 4 * CAPACITY, 5.0, CAPACITY)
    assert accepted >= 0.9 * 5 * CAPACITY  # the engine still answers (near) all it can ...
    assert sent <= 1.2 * throttle.k * accepted  # ... and sees about K calls per answer, not four
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


def serve(throttle: Throttle, clock: Clock, rate: float, seconds: float, slots: int, places: int,
          service_s: float, seed: int = 3) -> tuple[float, float]:
    """Poisson calls at `rate` a second for `seconds` through the throttle to an engine of `slots` slots and `places`
    places to wait, each call holding a slot for an exponential time of mean `service_s` (the engine's floor on one
    core: two slots, a queue a slot reaches within a call's time); a call finding slots and places taken is refused.
    (share of the time the slots were busy, share of offered calls sent to the engine)."""
    rng = random.Random(seed)
    busy_until: list[float] = []  # when each call in the engine leaves it, served in arrival order by `slots` slots
    busy_s = 0.0
    offered = sent = 0
    end = clock.now + seconds
    while clock.now < end:
        clock.now += rng.expovariate(rate)
        offered += 1
        busy_until = [t for t in busy_until if t > clock.now]
        if throttle.refuse():
            continue
        sent += 1
        accepted = len(busy_until) < slots + places
        if accepted:  # FIFO: it starts once the slot freed by the call `slots` places ahead of it is free
            ahead = sorted(busy_until)
            start = clock.now if len(ahead) < slots else ahead[len(ahead) - slots]
            held = rng.expovariate(1.0 / service_s)
            busy_until.append(start + held)
            busy_s += held
        throttle.answered(accepted)
    return busy_s / (slots * seconds), sent / offered


@pytest.mark.parametrize("slots", [1, 2, 4, 8])
def test_an_engine_with_few_slots_is_kept_busy_at_four_times_its_capacity(slots):
    """Calls refused by the engine are what tells the throttle to send more, and with a short queue the engine
    refuses some even below its capacity (calls bunch): sent K = send_ratio(slots) times what it accepts, it stays
    busy. At K = 1.5 a class of two slots with one place to wait was busy 0.76 of the time (an M/M/2/3 loss system)."""
    clock = Clock()
    throttle = Throttle(send_ratio(slots), clock, random.Random(slots).random)
    places, service_s = max(1, slots // 2), 0.004  # as the engine's queue: about a slot's worth per two slots
    capacity = slots / service_s
    serve(throttle, clock, 4 * capacity, 2.0, slots, places, service_s)  # the onset
    busy, sent = serve(throttle, clock, 4 * capacity, 5.0, slots, places, service_s, seed=slots + 10)
    assert busy >= 0.9
    assert sent <= 0.9  # the front still refuses part of the 4x itself


def test_the_fewer_the_slots_the_more_is_sent_per_call_accepted():
    ratios = [send_ratio(slots) for slots in (1, 2, 4, 8, 16, 64)]
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[0] < 4  # at 4x the front still refuses some itself
    assert ratios[-1] == MIN_K
