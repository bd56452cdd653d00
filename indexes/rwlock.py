"""A readers-writer lock that prefers writers.

Searches of a resident replica may run side by side (FAISS and numpy searches are safe for concurrent readers);
applying a change or swapping in a rebuilt index must run alone. Writers go first: a plain lock is not fair,
and under a steady stream of searches a change waited tens of milliseconds for its turn.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class ReadWriteLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @property
    def contended(self) -> bool:
        """A writer holds or waits for the lock (a hint, read without the lock): a reader now would wait."""
        return self._writing or self._writers_waiting > 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
