"""The event loop's lag probe and its refused share (service/admission/loop_lag.py)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest
import uvloop

from service.admission.control import Admission, Shed
from service.admission.loop_lag import BURST_S, DECREASE, INCREASE, MAX_SHARE, QUEUED_MIN, TICK_S, WINDOW, LoopLag
from service.settings import Settings


def test_one_slow_turn_moves_nothing_a_standing_lag_cuts_what_is_admitted_and_it_grows_back():
    lag = LoopLag(0.001)
    for sample in (0.0, 0.0, 0.050, 0.0, 0.0):  # one slow turn among turns on time
        lag.observe(sample)
    assert lag.share == 0 and lag.lag_s == 0
    for _ in range(10):
        lag.observe(0.010)  # ten times the target, standing from the third sample on
    # each such sample stands for 1 + 0.010 / TICK_S ticks; those past the burst allowance cut the admitted share
    # by DECREASE at most per tick
    past_burst = 8 - math.ceil(BURST_S / (TICK_S + 0.010))
    assert lag.lag_s == 0.010 and lag.share == pytest.approx(1 - DECREASE ** (past_burst * (1 + 0.010 / TICK_S)))
    behind = lag.share
    for _ in range(10):  # on time again: the admitted share grows by INCREASE per sample
        lag.observe(0.0)
    assert lag.share == pytest.approx(behind - 10 * INCREASE)
    for _ in range(100):
        lag.observe(0.0)
    assert lag.share == 0


def test_a_backlog_seconds_long_is_refused_at_once():
    """A sample comes only when the loop reads it: one sample of a 0.5 s backlog cuts as much as 100 ticks would."""
    lag = LoopLag(0.002)
    for _ in range(3):
        lag.observe(0.5)
    assert lag.share == MAX_SHARE


def test_a_burst_the_loop_drains_within_the_allowance_refuses_nothing_and_renews_it():
    lag = LoopLag(0.002)
    for _ in range(3):
        for _ in range(int(BURST_S / (TICK_S + 0.01)) - 1):  # behind by 10 ms, for less than the allowance
            lag.observe(0.010)
        assert lag.lag_s == 0.010 and lag.share == 0 and not lag.refuse_next()
        for _ in range(3):  # caught up: the whole allowance again for the next burst
            lag.observe(0.0)
    # a backlog that outlasts it is cut (it stands from the WINDOW-th sample on)
    for _ in range(WINDOW - 1 + math.ceil(BURST_S / (TICK_S + 0.01)) + 1):
        lag.observe(0.010)
    assert lag.share > 0 and any(lag.refuse_next() for _ in range(10))


def test_a_lag_few_requests_arrived_during_refuses_nothing():
    """Only a backlog of requests is refused for: a loop slowed by other work with one client's request now and then
    cannot be sped up by refusing it."""
    lag = LoopLag(0.002)
    for _ in range(100):
        lag.observe(0.010, arrived=QUEUED_MIN - 1)
    assert lag.lag_s == 0.010 and lag.queued_s == 0 and lag.share == 0
    for _ in range(100):
        lag.observe(0.010, arrived=QUEUED_MIN)
    assert lag.queued_s == 0.010 and lag.share > 0.5


def _hold_the_gil_in_long_calls(stop: threading.Event) -> None:
    """A job's thread: one C call that keeps the GIL for about 0.1 s at a time (sorting never lets it go)."""
    numbers = np.random.default_rng(0).random(600_000).tolist()
    while not stop.is_set():
        sorted(numbers)


def _spin(seconds: float) -> None:
    """Work on the calling thread (Python running)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


async def _most_lag_and_share(requests_per_turn: int, turn_s: float, job: bool) -> tuple[float, float, float]:
    """For a second, `requests_per_turn` requests arrive in each turn of the running loop, which works `turn_s` on
    them, then waits 1 ms for the next (beside a job's thread holding the GIL, if `job`): the most standing lag,
    the most share refused and the longest single probe the gate saw."""
    lag = LoopLag(0.002)
    lag.start(asyncio.get_running_loop())
    stop = threading.Event()
    holder = threading.Thread(target=_hold_the_gil_in_long_calls, args=(stop,))
    if job:
        holder.start()
    most_lag = most_share = most_probe = 0.0
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for _ in range(requests_per_turn):
                lag.arrive()
            _spin(turn_s)
            await asyncio.sleep(0.001 if not turn_s else 0)
            most_lag, most_share = max(most_lag, lag.lag_s), max(most_share, lag.share)
            most_probe = max(most_probe, *lag._samples, 0.0)
    finally:
        stop.set()
        if holder.is_alive():
            holder.join()
        lag.stop()
    return most_lag, most_share, most_probe


def test_a_job_holding_the_gil_is_seen_and_refuses_nothing():
    """One client, one request at a time, while a job's thread holds the GIL for 0.1 s at a time. On uvloop (what
    the service runs on): asyncio's own loop sends the probe from a timer that, starved of the GIL, fires only once
    the loop has it again, so there the stall is not seen at all."""
    _, share, probe_s = uvloop.run(_most_lag_and_share(1, 0.0, job=True))
    # The stalls are seen by the probe, and nothing is refused for them. (Not always as a standing lag, the least
    # of three samples: a probe due during a stall is read at once after it, so samples alternate ~0 and ~100 ms.)
    assert probe_s > 0.01 and share == 0


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_backlog_of_requests_is_refused_for(loop_factory):
    loop = loop_factory()
    try:  # 5 requests a turn, 10 ms of work on them
        lag_s, share, _ = loop.run_until_complete(_most_lag_and_share(5, 0.01, job=False))
    finally:
        loop.close()
    assert lag_s > 0.004 and share > 0.5


def test_without_a_target_the_lag_is_measured_and_nothing_refused():
    lag = LoopLag(0.0)
    for _ in range(10):
        lag.observe(0.5)
    assert lag.lag_s == 0.5 and lag.share == 0 and not lag.refuse_next()


def test_the_share_refused_is_spread_evenly():
    lag = LoopLag(0.001)
    lag.share = 0.25
    refused = [lag.refuse_next() for _ in range(100)]
    assert sum(refused) == 25 and all(sum(refused[i:i + 4]) == 1 for i in range(0, 100, 4))


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_the_probe_sees_a_loop_kept_busy_and_then_idle(loop_factory):
    async def measure() -> tuple[float, float]:
        lag = LoopLag(0.0)
        lag.start(asyncio.get_running_loop())
        try:
            stop = time.monotonic() + 0.3
            while time.monotonic() < stop:  # turns of 20 ms each: readable sockets wait about that long
                time.sleep(0.02)
                await asyncio.sleep(0)
            busy = lag.lag_s
            await asyncio.sleep(0.2)
            return busy, lag.lag_s
        finally:
            lag.stop()

    loop = loop_factory()
    try:
        busy, idle = loop.run_until_complete(measure())
    finally:
        loop.close()
    assert busy >= 0.005 and idle < 0.005


def test_admission_refuses_the_share_once_per_request(tmp_path):
    admission = Admission(Settings(data_dir=tmp_path, loop_lag_target_ms=1.0))
    assert not admission.crowded()
    admission.loop_lag.share = 0.5
    assert admission.crowded()
    outcomes = []
    for _ in range(4):
        try:
            admission.check_room("light")
            outcomes.append("admitted")
        except Shed as exc:
            assert exc.extra["reason"] == "loop_lag" and exc.headers["Retry-After"] == "1"
            outcomes.append("refused")
    assert outcomes.count("refused") == 2
    for _ in range(4):  # screened by the protocol already: not counted again
        admission.check_room("light", screened=True)
