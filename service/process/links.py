"""The sockets `switchyard serve` hands its engine and front processes. Not configuration: the parent sets them in
each child's environment (one variable, JSON), never in its own, and Settings does not read them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

VARIABLE = "_SWITCHYARD_PROCESS_LINKS"


@dataclass(frozen=True)
class EngineSockets:
    """One engine process's unix sockets: parsed searches and upserts (`calls`), and HTTP for every other request."""

    calls: Path
    http: Path


@dataclass(frozen=True)
class ProcessLinks:
    """Every engine process's sockets, and which of them this process serves (None: a front, or no layout)."""

    engines: tuple[EngineSockets, ...] = ()
    serving: int | None = None

    def as_engine(self, index: int) -> ProcessLinks:
        return ProcessLinks(self.engines, index)

    def environment(self) -> dict[str, str]:
        """What to add to a child's environment so that it finds these links."""
        engines = [[str(e.calls), str(e.http)] for e in self.engines]
        return {VARIABLE: json.dumps({"engines": engines, "serving": self.serving})}

    @classmethod
    def handed_down(cls, environ: Mapping[str, str] | None = None) -> ProcessLinks:
        """The links this process was started with (none when it was not started by `switchyard serve`)."""
        raw = (os.environ if environ is None else environ).get(VARIABLE)
        if not raw:
            return cls()
        value = json.loads(raw)
        return cls(tuple(EngineSockets(Path(c), Path(h)) for c, h in value["engines"]), value["serving"])

    @property
    def engine_socket(self) -> Path | None:
        """The socket this engine process answers the fronts' parsed requests on."""
        return self.engines[self.serving].calls if self.serving is not None else None
