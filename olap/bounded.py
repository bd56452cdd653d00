"""A call with a deadline that cannot be interrupted (a GPU query): it runs in a thread of its own, the caller
waits at most the deadline, and a call that overran keeps its thread until it ends, refusing the next call
meanwhile. So a timed-out query never holds the engine's worker, and at most one straggler holds the device."""

from __future__ import annotations

import threading
from typing import Any, Callable


class EngineBusy(RuntimeError):
    """An earlier call that ran past its deadline is still running."""


class BoundedRunner:
    def __init__(self, name: str) -> None:
        self.name = name
        self._straggler: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._straggler is not None and self._straggler.is_alive()

    def run(self, fn: Callable[[], Any], timeout_s: float | None) -> Any:
        if self.busy:
            raise EngineBusy(f"an earlier {self.name} call ran past its deadline and is still running")
        if timeout_s is None:
            return fn()
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=call, name=f"{self.name}-bounded", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self._straggler = thread
            raise TimeoutError(f"the query ran past its {timeout_s:g} s limit")
        if "error" in box:
            raise box["error"]
        return box["value"]
