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

    def __init__(self, seconds: float = 0.0, fail: bool = False) -> None:
        self.seconds, self.fail, self.calls = seconds, fail, []

    def __call__(self, key, queries: np.ndarray):
        if self.seconds:
            time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("engine failed")
        self.calls.append(len(queries))
        return [(float(q.sum()), threading.get_ident(), len(queries)) for q in queries]


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

        async def go():
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
