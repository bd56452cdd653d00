"""Spatial joins at an ingress whose point layers are partitioned across spatial hosts elsewhere (a Ray cluster).

Point-in-polygon joins go to the partitions (polygon layers are with every one): counts from one replica of every
partition add up; pairs page through the partitions in turn, under a cursor naming the partition and the position
inside it. Distance joins, layer writes and PostGIS stay on this process's own engines, which hold every layer
(one worker holding everything); `auto` falls back to them when a partition has no replica able to answer.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from indexes.errors import ShardUnavailable
from service.cluster.fanout import ShardSet
from service.cluster.parts import WatchesParts
from spatial.manager import JoinAnswer, SpatialManager
from spatial.partitions import decode_cursor, next_cursor, sum_counts

PARTITION_ENGINES = ("auto", "cpu-spatial", "cuda-spatial", "cpu", "gpu")


class PartitionedSpatial(WatchesParts, SpatialManager):
    def __init__(self, pool: Any, guard: Any, partitions: ShardSet,
                 observe: Callable[[str, str, float, bool], None] | None = None) -> None:
        super().__init__(pool, guard, observe)
        self.parts = partitions

    async def point_in_polygon(self, points: str, polygons: str, mode: str, engine: str, cursor: str | None,
                               page_size: int) -> JoinAnswer:
        self.layer(points, "points", "points")  # 404 / 422 here, before any partition is asked
        self.layer(polygons, "polygons", "polygons")
        if engine not in PARTITION_ENGINES:
            return await super().point_in_polygon(points, polygons, mode, engine, cursor, page_size)
        started = time.perf_counter()
        try:
            current = await self.store.versions()
            versions = {points: current.get(points), polygons: current.get(polygons)}
            if mode == "counts":
                parts = await self.parts.on_every_shard("point_in_polygon", versions, points, polygons, mode,
                                                        engine, None, page_size)
                body, served = sum_counts([b for b, _ in parts]), parts[0][1]
            else:
                part, inner = decode_cursor(cursor, self.parts.shards)
                body, served = await self.parts.on_shard(part, "point_in_polygon", versions, points, polygons,
                                                         mode, engine, inner, page_size)
                body = {**body, "next_cursor": next_cursor(part, self.parts.shards, body["next_cursor"])}
        except ShardUnavailable as exc:
            if engine != "auto" or cursor is not None:  # a partitioned cursor means nothing to the engines here
                raise
            answer = await super().point_in_polygon(points, polygons, mode, engine, cursor, page_size)
            answer.fallback = f"{exc.detail}; served by {answer.engine} here"
            return answer
        took = time.perf_counter() - started
        self.observe(served, "pip_" + mode, took, True)
        return JoinAnswer(body, served, round(took * 1000, 3))
