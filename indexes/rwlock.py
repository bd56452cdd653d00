"""A readers-writer lock that prefers writers.

Searches of a resident replica may run side by side (FAISS and numpy searches are safe for concurrent readers);
applying a change or swapping in a rebuilt index must run alone. Writers go first: a plain lock is not fair,
and under a steady stream of searches a change waited tens of milliseconds for its turn.
"""

from __future__ import annotations

import threading
from typing import Callable


class ReadWriteLock:
    def __init__(self) -> None:
        self._mutex = threading.Lock()  # taken directly where nothing waits: Condition's own `with` is Python
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        # `with lock.read():` / `with lock.write():` take these (stateless, so shared by every thread); classes
        # rather than generator context managers: a search takes the read side once, at a cost worth a microsecond.
        self._read, self._write = _Side(self._enter_read, self._exit_read), _Side(self._enter_write, self._exit_write)

    @property
    def contended(self) -> bool:
        """A writer holds or waits for the lock (a hint, read without the lock): a reader now would wait."""
        return self._writing or self._writers_waiting > 0

    def read(self) -> "_Side":
        return self._read

    def write(self) -> "_Side":
        return self._write

    def _enter_read(self) -> None:
        with self._mutex:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def _exit_read(self) -> None:
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._writers_waiting:  # readers wait only while a writer writes or waits
                self._cond.notify_all()

    def _enter_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True

    def _exit_write(self) -> None:
        with self._cond:
            self._writing = False
            self._cond.notify_all()


class _Side:
    __slots__ = ("_enter", "_exit")

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None]) -> None:
        self._enter, self._exit = enter, leave

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        self._exit()
