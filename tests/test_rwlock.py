"""The replicas' readers-writer lock: readers share it, a writer is alone, and a waiting writer goes before
readers that arrive after it (searches must not starve the changes of a replica)."""

from __future__ import annotations

import threading
import time

from indexes.rwlock import ReadWriteLock


def test_readers_share_writers_exclude_and_a_waiting_writer_goes_first():
    lock = ReadWriteLock()
    events: list[str] = []
    inside = threading.Semaphore(0)
    release_first = threading.Event()

    def reader(name: str, hold: threading.Event | None) -> None:
        with lock.read():
            events.append(f"{name} in")
            inside.release()
            if hold is not None:
                hold.wait(5)
            events.append(f"{name} out")

    def writer() -> None:
        with lock.write():
            events.append("writer in")
            time.sleep(0.05)
            events.append("writer out")

    first = threading.Thread(target=reader, args=("r1", release_first))
    second = threading.Thread(target=reader, args=("r2", release_first))
    first.start(), second.start()
    assert inside.acquire(timeout=5) and inside.acquire(timeout=5)  # two readers at once
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.05)
    late = threading.Thread(target=reader, args=("r3", None))  # arrives while the writer waits
    late.start()
    time.sleep(0.05)
    assert "writer in" not in events and "r3 in" not in events
    release_first.set()
    for t in (first, second, w, late):
        t.join(5)
    assert events.index("writer in") > max(events.index("r1 out"), events.index("r2 out"))
    assert events.index("r3 in") > events.index("writer out")


def test_contended_says_when_a_reader_would_wait():
    lock = ReadWriteLock()
    assert not lock.contended
    with lock.read():
        assert not lock.contended
    with lock.write():
        assert lock.contended
    assert not lock.contended
