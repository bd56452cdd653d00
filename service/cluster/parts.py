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

    @property
    def parts_ready(self) -> bool:
        """Every part has a replica that said it is ready at the last watch, which told them what the manager
        holds now (an SSB dataset activated since then is not theirs yet): what /readyz waits for."""
        return self.parts.every_shard_up() and self.parts.watched_with == self.watch_args()
