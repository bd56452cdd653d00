"""The micro-batcher (indexes/batching.py): lone cheap searches on the event loop, everything else batched on a
worker thread, every caller answered."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from indexes.batching import MicroBatcher


class Engine:
    """Answers each query row with (row sum, thread it ran on, batch size); optionally slow or failing."""

    def __init__(self, seconds: float = 0.0, fail: bool = False, clock: "Ticking | None" = None) -> None:
        self.seconds, self.fail, self.calls, self.clock = seconds, fail, [], clock

    def __call__(self, key, queries: np.ndarray):
        if self.seconds:
            time.sleep(self.seconds)
            if self.clock is not None:
                self.clock.now += self.seconds
        if self.fail:
            raise RuntimeError("engine failed")
        self.calls.append(len(queries))
        return [(float(q.sum()), threading.get_ident(), len(queries)) for q in queries]


class Ticking:
    """The batcher's perf_counter, moved by the engine by exactly what each call is said to take: a turn's budget
    then does not depend on how long a sleep lasts on a loaded machine (a 10 ms sleep took 13 ms once, and a third
    search no longer fitted a 35 ms turn)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_a_lone_cheap_search_runs_on_the_loop_after_it_proved_cheap():
    engine = Engine()
    batcher = MicroBatcher(engine, ThreadPoolExecutor(2), inline_below_s=0.01)

    async def go():
        loop_thread = threading.get_ident()
        first = await batcher.submit("c", np.ones(4))
        later = [await batcher.submit("c", np.full(4, i)) for i in range(5)]
        return loop_thread, first, later

    loop_thread, first, later = run(go())
    assert first[1] != loop_thread  # unknown cost: measured on a worker thread first
    assert all(r[1] == loop_thread for r in later) and [r[0] for r in later] == [0.0, 4.0, 8.0, 12.0, 16.0]
    assert batcher.inline == 5


def test_slow_searches_and_vetoed_ones_stay_on_threads():
    for engine, veto in ((Engine(seconds=0.02), None), (Engine(), lambda key: False)):
        batcher = MicroBatcher(engine, ThreadPoolExecutor(2), inline_below_s=0.005, can_inline=veto)

        async def go(batcher=batcher):
            loop_thread = threading.get_ident()
            return loop_thread, [await batcher.submit("c", np.ones(2)) for _ in range(4)]

        loop_thread, answers = run(go())
        assert all(r[1] != loop_thread for r in answers) and batcher.inline == 0


def test_concurrent_searches_are_still_batched_and_all_answered():
    engine = Engine(seconds=0.005)
    batcher = MicroBatcher(engine, ThreadPoolExecutor(2), inline_below_s=0.5)

    async def go():
        await batcher.submit("c", np.ones(3))  # proves it cheap enough to inline when alone
        return await asyncio.gather(*(batcher.submit("c", np.full(3, i)) for i in range(20)))

    answers = run(go())
    assert [a[0] for a in answers] == [3.0 * i for i in range(20)]
    assert max(engine.calls) > 1  # while one call ran, the others queued and went together


def test_an_engine_error_reaches_the_caller_inline_or_not():
    engine = Engine()
    batcher = MicroBatcher(engine, ThreadPoolExecutor(1), inline_below_s=0.01)

    async def go():
        await batcher.submit("c", np.ones(2))
        engine.fail = True
        with pytest.raises(RuntimeError, match="engine failed"):
            await batcher.submit("c", np.ones(2))  # inline
        batcher.inline_below_s = 0.0
        with pytest.raises(RuntimeError, match="engine failed"):
            await batcher.submit("c", np.ones(2))  # on a thread

    run(go())


def test_try_inline_answers_at_once_only_what_submit_would_inline_and_within_the_turn_budget(monkeypatch):
    # 10 ms a search, 35 ms a turn: three searches, then the fourth would pass the budget
    clock = Ticking()
    monkeypatch.setattr("indexes.batching.time", clock)
    engine = Engine(seconds=0.01, clock=clock)
    batcher = MicroBatcher(engine, ThreadPoolExecutor(2), inline_below_s=0.05, turn_budget_s=0.035)

    async def go():
        assert batcher.try_inline("c", np.ones(2)) is None  # its cost is unknown yet
        await batcher.submit("c", np.ones(2))  # measured on a worker thread
        loop_thread = threading.get_ident()
        turn = [batcher.try_inline("c", np.full(2, i)) for i in range(5)]
        await asyncio.sleep(0)  # the next turn of the loop
        again = batcher.try_inline("c", np.full(2, 7.0))
        engine.seconds = 0.08  # two searches arriving together: a batch in flight on the worker thread ...
        held = [asyncio.ensure_future(batcher.submit("c", np.ones(2))) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert batcher._lanes["c"].busy
        busy = batcher.try_inline("c", np.ones(2))
        await asyncio.gather(*held)
        engine.seconds = 0.0
        return loop_thread, turn, again, busy

    loop_thread, turn, again, busy = run(go())
    assert [r[0] for r in turn[:3]] == [0.0, 2.0, 4.0] and all(r[1] == loop_thread for r in turn[:3])
    assert turn[3:] == [None, None]  # past the budget: requests arriving together go to the thread as a batch
    assert again[0] == 14.0
    assert busy is None  # ... is never overtaken by an inline search


def test_cheap_searches_arriving_together_all_fit_in_one_turn():
    engine = Engine()  # microseconds a search: a turn's budget holds dozens
    batcher = MicroBatcher(engine, ThreadPoolExecutor(2), inline_below_s=0.01, turn_budget_s=0.005)

    async def go():
        await batcher.submit("c", np.ones(2))
        return [batcher.try_inline("c", np.full(2, i)) for i in range(32)]

    turn = run(go())
    assert [r[0] for r in turn] == [2.0 * i for i in range(32)]


def test_try_inline_leaves_slow_or_vetoed_searches_and_passes_engine_errors():
    slow = MicroBatcher(Engine(seconds=0.02), ThreadPoolExecutor(1), inline_below_s=0.005)
    vetoed = MicroBatcher(Engine(), ThreadPoolExecutor(1), inline_below_s=0.005, can_inline=lambda key: False)
    failing = Engine()
    flaky = MicroBatcher(failing, ThreadPoolExecutor(1), inline_below_s=0.005)

    async def go():
        for batcher in (slow, vetoed, flaky):
            await batcher.submit("c", np.ones(2))
        assert slow.try_inline("c", np.ones(2)) is None and vetoed.try_inline("c", np.ones(2)) is None
        failing.fail = True
        with pytest.raises(RuntimeError, match="engine failed"):
            flaky.try_inline("c", np.ones(2))

    run(go())


def test_learnt_costs_are_bounded_and_the_oldest_key_is_forgotten_first():
    """Filtered searches make keys without end (the filter's text is in the key): the batcher remembers the cost of
    at most `learnt_keys` of them, so memory stays bounded, and forgets the oldest first."""
    batcher = MicroBatcher(Engine(), ThreadPoolExecutor(1), inline_below_s=0.05, learnt_keys=8)

    async def go():
        for i in range(100):
            batcher.timed(f"filter-{i}", np.ones((1, 2)))  # each learnt on its first search
        recent = batcher.try_inline("filter-99", np.ones(2))  # its cost is known: answered inline
        await asyncio.sleep(0)
        oldest = batcher.try_inline("filter-0", np.ones(2))  # forgotten: unknown cost, not inline
        return recent, oldest

    recent, oldest = run(go())
    assert recent is not None and oldest is None
    assert len(batcher._lone_cost) <= 8
