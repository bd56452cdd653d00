"""Progress of a long call (a bulk load, a job): tqdm's bar when tqdm is installed, else a line on stderr at most
once a second; or the caller's own function."""

from __future__ import annotations

import sys
import time
from typing import Callable, Union

ProgressFn = Callable[[int, int, str], None]  # (done, total, message)
ProgressArg = Union[bool, ProgressFn]


class _Line:
    def __init__(self, description: str) -> None:
        self.description = description
        self.shown = 0.0

    def __call__(self, done: int, total: int, message: str) -> None:
        now = time.monotonic()
        if now - self.shown >= 1.0 or (total and done >= total):
            self.shown = now
            share = f" {100 * done / total:.0f}%" if total else ""
            print(f"{self.description}:{share} {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, description: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(desc=description, unit="row", unit_scale=True)

    def __call__(self, done: int, total: int, message: str) -> None:
        if total and self.bar.total != total:
            self.bar.total = total
        self.bar.n = done
        self.bar.set_postfix_str(message[:60], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class Reporter:
    """What a call reports its progress to; `close()` when it ends."""

    def __init__(self, progress: ProgressArg, description: str) -> None:
        self.own: _Line | _Bar | None = None
        self.fn: ProgressFn | None
        if progress is True:
            try:
                self.own = _Bar(description)
            except ImportError:
                self.own = _Line(description)
            self.fn = self.own
        else:
            self.fn = progress or None

    def __call__(self, done: int, total: int, message: str = "") -> None:
        if self.fn is not None:
            self.fn(done, total, message)

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
