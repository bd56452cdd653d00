"""What every domain manager of an ingress shares when part of its work runs on hosts placed elsewhere."""

from __future__ import annotations

from typing import Any

from service.cluster.fanout import ShardSet


class WatchesParts:
    """A mixin before a domain manager: watches its hosts (`parts`) while the manager runs, and describes them.
    `watch_args()` is what each host's start() is given on every watch."""

    parts: ShardSet
    part_label = "partition"

    def watch_args(self) -> tuple:
        return ()

    async def start(self, *args: Any, **kwargs: Any) -> None:  # whatever the manager's own start() takes
        await super().start(*args, **kwargs)  # type: ignore[misc]
        self.parts.start_watching(self.watch_args)

    async def stop(self) -> None:
        await self.parts.stop_watching()
        await super().stop()  # type: ignore[misc]

    async def layout(self) -> list[dict[str, Any]]:
        return await self.parts.layout(self.part_label)
