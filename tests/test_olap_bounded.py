"""olap/bounded.py: an uninterruptible call (a cudf-polars collect) past its deadline frees its caller at once and
holds no worker; the next call is refused until the straggler ends."""

from __future__ import annotations

import threading
import time

import pytest

from olap.bounded import BoundedRunner, EngineBusy


def test_a_call_past_its_deadline_returns_at_once_and_blocks_only_the_next_call():
    runner = BoundedRunner("test")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="0.1 s limit"):
        runner.run(lambda: release.wait(10), 0.1)
    assert time.monotonic() - started < 2 and runner.busy
    with pytest.raises(EngineBusy):
        runner.run(lambda: 1, 1.0)
    release.set()
    for _ in range(100):
        if not runner.busy:
            break
        time.sleep(0.02)
    assert runner.run(lambda: 42, 1.0) == 42
    assert runner.run(lambda: 7, None) == 7


def test_errors_and_values_come_back_from_the_thread():
    runner = BoundedRunner("test")
    with pytest.raises(ZeroDivisionError):
        runner.run(lambda: 1 / 0, 1.0)
    assert runner.run(lambda: [1, 2], 1.0) == [1, 2]
