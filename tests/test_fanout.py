"""The ingress's choice of shard replicas (service/cluster/fanout.py), with plain objects as replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from indexes.errors import InvalidInput, ShardUnavailable
from service.cluster import fanout
from service.cluster.fanout import ShardSet


class Replica:
    def __init__(self, name: str, delay: float = 0.0, error: BaseException | None = None) -> None:
        self.name, self.delay, self.error, self.calls = name, delay, error, 0

    async def answer(self) -> str:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.name


async def call(replica: Replica, method: str, args: tuple) -> Any:
    return await getattr(replica, method)(*args)


def up(shard_set: ShardSet) -> None:
    shard_set.note([[{"ready": True, "engine": "cpu"} for _ in row] for row in shard_set.replicas])


def test_a_replica_that_does_not_answer_is_joined_by_the_next_and_the_first_answer_wins(monkeypatch):
    monkeypatch.setattr(fanout, "HEDGE_MAX_S", 0.05)
    stuck, quick = Replica("stuck", delay=30), Replica("quick")
    shards = ShardSet([[stuck, quick]], call, call_timeout_s=60)
    up(shards)

    async def run() -> list[str]:
        return [await shards.on_shard(0, "answer") for _ in range(4)]

    assert asyncio.run(run()) == ["quick"] * 4  # round robin starts on each in turn; stuck never answers
    assert stuck.calls >= 1 and quick.calls == 4


def test_a_failing_replica_is_passed_over_and_asked_last_until_it_is_seen_ready():
    broken, fine = Replica("broken", error=ConnectionError("gone")), Replica("fine")
    shards = ShardSet([[broken, fine]], call)
    up(shards)

    async def run() -> list[str]:
        return [await shards.on_shard(0, "answer") for _ in range(6)]

    assert asyncio.run(run()) == ["fine"] * 6
    assert broken.calls == 1 and shards.is_down(0, 0)  # down after its failure: asked last from then on
    up(shards)
    assert not shards.is_down(0, 0)


def test_the_requests_own_error_comes_back_without_asking_other_replicas():
    first, second = Replica("a", error=InvalidInput("bad", field="params")), Replica("b")
    shards = ShardSet([[first, second]], call)
    up(shards)
    shards._turn[0] = 1  # the next call starts on replica 0 ("a")
    with pytest.raises(InvalidInput):
        asyncio.run(shards.on_shard(0, "answer"))
    assert second.calls == 0 and not shards.is_down(0, 0)


def test_a_shard_with_no_replica_able_to_answer_is_unavailable_and_readiness_says_so(monkeypatch):
    monkeypatch.setattr(fanout, "ALL_DOWN_WAIT_S", 0.2)
    shards = ShardSet([[Replica("x")], [Replica("dead", error=RuntimeError("boom")), Replica("slow", delay=30)]],
                      call)
    assert not shards.every_shard_up()  # nothing heard yet
    shards.note([[{"ready": True}], [RuntimeError("no answer"), {"ready": False}]])
    assert not shards.every_shard_up()

    async def run() -> Any:
        return await shards.on_every_shard("answer")

    with pytest.raises(ShardUnavailable) as caught:
        asyncio.run(run())
    assert "shard 1 of 2" in caught.value.detail
    shards.note([[{"ready": True}], [{"ready": True}, {"ready": False}]])
    assert shards.every_shard_up()


def test_layout_describes_every_replica_or_why_it_could_not():
    class Host:
        def __init__(self, error: BaseException | None = None) -> None:
            self.error = error

        async def where(self) -> dict:
            if self.error:
                raise self.error
            return {"ready": True}

    shards = ShardSet([[Host(), Host(ConnectionError("refused"))]], call)
    assert asyncio.run(shards.layout("shard")) == [
        {"shard": 0, "replicas": [{"ready": True}, {"ready": False, "error": "ConnectionError: refused"}]}]
