"""Admission control: engine gates with short queues, deadlines, quotas, circuit breakers, and their HTTP answers."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from service.admission.control import (
    Admission,
    CoolingDown,
    DeadlineExceeded,
    Gate,
    OverQuota,
    QueueDeadline,
    Shed,
    parse_timeout,
)
from service.admission.deadlines import remaining, set_deadline
from service.errors import BadRequest
from service.settings import Settings
from tests.conftest import run
from tests.helpers import assert_problem, wait_ready


def settings(**overrides):
    values = dict(admission=True, queue_wait_ms=200.0, queue_depth=None, batch_max=4, db_pool_max=4, sql_pool_max=2,
                  quota_requests_per_s=0.0, quota_burst=0.0, quota_engine_seconds_per_s=0.0,
                  quota_engine_seconds_burst=None, breaker_failures=3, breaker_cooldown_s=0.2, max_inflight=64,
                  min_inflight=2, inflight_latency_tolerance=2.0)
    values.update(overrides)
    return Settings(**values)


# -- the gate -------------------------------------------------------------------------------------------

def test_gate_admits_up_to_its_limit_queues_fifo_and_sheds_past_its_depth():
    async def go():
        gate = Gate("faiss", limit=2, depth=2, max_wait_s=5.0)
        await gate.acquire(None)
        await gate.acquire(None)
        order = []

        async def waiter(i):
            await gate.acquire(None)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert len(gate.waiters) == 2 and order == []
        with pytest.raises(Shed) as shed:
            await gate.acquire(None)
        assert shed.value.status == 503 and shed.value.extra["reason"] == "queue_full"
        assert int(shed.value.headers["Retry-After"]) >= 1
        gate.release(0.01)
        await asyncio.sleep(0.01)
        assert order == [0] and gate.active == 2  # the slot passed straight to the first waiter
        gate.release(0.01)
        await asyncio.gather(*tasks)
        assert order == [0, 1] and gate.active == 2
        gate.release()
        gate.release()
        assert gate.active == 0 and not gate.waiters

    run(go())


def test_a_queued_request_gives_up_after_the_queue_wait_or_its_deadline():
    async def go():
        gate = Gate("duckdb", limit=1, depth=4, max_wait_s=0.05)
        await gate.acquire(None)
        started = time.monotonic()
        with pytest.raises(Shed) as waited:
            await gate.acquire(None)
        assert waited.value.extra["reason"] == "queue_wait" and not isinstance(waited.value, QueueDeadline)
        assert 0.04 < time.monotonic() - started < 1.0
        with pytest.raises(QueueDeadline) as late:
            await gate.acquire(time.monotonic() + 0.01)
        assert late.value.status == 503 and late.value.slug == "deadline-exceeded"
        assert gate.active == 1 and not gate.waiters  # nobody left behind in the queue
        gate.release()
        assert gate.active == 0

    run(go())


def test_a_cancelled_waiter_returns_a_slot_handed_to_it():
    async def go():
        gate = Gate("cuvs", limit=1, depth=4, max_wait_s=5.0)
        await gate.acquire(None)
        task = asyncio.create_task(gate.acquire(None))
        await asyncio.sleep(0.01)
        gate.release()  # handed to the waiter ...
        task.cancel()  # ... which goes away before it runs
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.active == 0 and not gate.waiters
        await gate.acquire(None)  # the slot is free again
        assert gate.active == 1

    run(go())


# -- quotas, breakers, deadlines ------------------------------------------------------------------------

def test_request_quota_is_a_token_bucket_per_principal():
    admission = Admission(settings(quota_requests_per_s=20.0, quota_burst=2.0))
    admission.check_request("key:a")
    admission.check_request("key:a")
    with pytest.raises(OverQuota) as over:
        admission.check_request("key:a")
    assert over.value.status == 429 and over.value.headers["Retry-After"] == "1"
    admission.check_request("key:b")  # another principal has its own bucket
    time.sleep(0.06)  # 20 per second: one token back
    admission.check_request("key:a")


def test_engine_seconds_quota_refuses_once_spent():
    async def go():
        admission = Admission(settings(quota_engine_seconds_per_s=0.01, quota_engine_seconds_burst=0.05))
        async with admission.slot("duckdb"):
            await asyncio.sleep(0.08)  # spends more than the burst
        with pytest.raises(OverQuota):
            async with admission.slot("duckdb"):
                pass

    run(go())


def test_breaker_routes_around_a_failing_engine_then_probes_it():
    async def go():
        admission = Admission(settings(breaker_failures=3, breaker_cooldown_s=0.1))
        for _ in range(2):
            admission.failed("faiss")
        assert admission.cooling("faiss") is None
        admission.failed("faiss")
        assert "cooling down after 3 failures" in admission.cooling("faiss")
        with pytest.raises(CoolingDown) as cooling:
            async with admission.slot("faiss"):
                pass
        assert cooling.value.status == 503 and int(cooling.value.headers["Retry-After"]) >= 1
        await asyncio.sleep(0.12)
        assert admission.cooling("faiss") is None  # this caller probes ...
        assert admission.cooling("faiss") is not None  # ... the others still go around
        admission.succeeded("faiss")
        assert admission.cooling("faiss") is None and "faiss" not in admission.breakers
        for _ in range(5):
            admission.failed("pgvector")  # the database supervisor watches PostgreSQL's engines
        assert admission.cooling("pgvector") is None

    run(go())


def test_a_slot_taken_at_once_only_where_slot_would_neither_wait_refuse_charge_nor_bound():
    async def go():
        admission = Admission(settings(batch_max=1))  # faiss: 2 slots
        first, second = admission.try_slot("faiss"), admission.try_slot("faiss")
        assert first is second is admission.gate("faiss") and admission.try_slot("faiss") is None  # full
        waiting = asyncio.ensure_future(admission.slot("faiss").__aenter__())
        await asyncio.sleep(0)
        assert admission.gate("faiss").waiters and admission.try_slot("faiss") is None
        first.release(0.001)
        await waiting  # the freed slot went to the waiter, not to a call that could run at once
        assert admission.gate("faiss").active == 2 and admission.try_slot("faiss") is None
        second.release(None)
        assert admission.try_slot("faiss") is not None
        for _ in range(3):
            admission.failed("cuvs")
        assert admission.try_slot("cuvs") is None  # cooling down: slot() would refuse
        assert Admission(settings(quota_engine_seconds_per_s=1.0)).try_slot("faiss") is None  # slot() charges
        set_deadline(time.monotonic() + 5)
        assert admission.try_slot("pgvector") is None  # slot() bounds the call
        off = Admission(settings(admission=False))
        assert off.try_slot("faiss") is not None and off.gate("faiss").active == 0

    run(go())


def test_a_deadline_bounds_the_engine_call_and_frees_the_slot():
    async def go():
        admission = Admission(settings())
        set_deadline(time.monotonic() + 0.05)
        with pytest.raises(DeadlineExceeded) as late:
            async with admission.slot("duckdb"):
                await asyncio.sleep(1.0)
        assert late.value.status == 504
        assert admission.gates["duckdb"].active == 0
        set_deadline(time.monotonic() + 0.05)
        async with admission.slot("writes", bound_run=False):
            await asyncio.sleep(0.06)  # a write is not cut off: only its wait for a slot is bounded
        with pytest.raises(QueueDeadline):  # the deadline has passed: not run at all
            async with admission.slot("duckdb"):
                raise AssertionError("ran past its deadline")

    run(go())


def test_a_deadline_belongs_to_its_task_not_to_tasks_it_starts():
    async def go():
        set_deadline(time.monotonic() + 10)
        assert 9 < remaining() <= 10

        async def child():
            return remaining()

        assert await asyncio.create_task(child()) is None  # a drain or job started from a request has none

    run(go())


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "3601", "", "1_0", b"1_0"])
def test_bad_timeouts_are_refused(value):
    with pytest.raises(BadRequest) as bad:
        parse_timeout(value)
    assert bad.value.field == "X-Request-Timeout"


def test_timeouts_parse():
    assert parse_timeout(b"0.25") == 0.25 and parse_timeout("3600") == 3600


# -- over HTTP ----------------------------------------------------------------------------------------

@pytest.fixture
def small(make_client):
    """A service whose pgvector engine runs one search at a time with no queue."""
    client = make_client(raise_server_exceptions=False, db_pool_max=2, queue_depth=0)
    wait_ready(client)
    rng = np.random.default_rng(0)
    client.delete("/v1/collections/adm")  # the database lives as long as this module
    assert client.post("/v1/collections", json={"name": "adm", "dim": 4}).status_code == 201
    points = {"ids": list(range(50)), "vectors": rng.random((50, 4)).tolist()}
    assert client.put("/v1/collections/adm/points", json=points).status_code == 200
    return client


def hold(client, engine):
    """Take every slot of an engine's gate, from the app's own event loop."""
    admission = client.app.state.switchyard.admission
    gate = admission.gate(engine)
    for _ in range(gate.limit):
        client.portal.call(gate.acquire, None)
    return gate


def test_a_full_engine_answers_503_with_retry_after_and_runs_nothing(small):
    gate = hold(small, "pgvector")
    r = small.post("/v1/collections/adm/search", json={"vector": [0.5] * 4, "k": 3, "engine": "pgvector"})
    body = assert_problem(r, 503, "overloaded")
    assert int(r.headers["Retry-After"]) >= 1 and body["engine"] == "pgvector" and body["reason"] == "queue_full"
    metrics = small.get("/metrics").text
    assert 'switchyard_shed_total{engine="pgvector",reason="queue_full"} 1.0' in metrics
    assert 'switchyard_engine_running{engine="pgvector"} 1.0' in metrics
    for _ in range(gate.limit):
        small.portal.call(gate.release)
    ok = small.post("/v1/collections/adm/search", json={"vector": [0.5] * 4, "k": 3, "engine": "pgvector"})
    assert ok.status_code == 200 and len(ok.json()["ids"]) == 3
    assert 'switchyard_admitted_total{engine="pgvector"}' in small.get("/metrics").text


def test_a_request_past_its_deadline_is_not_run(small):
    r = small.post("/v1/collections/adm/search", json={"vector": [0.5] * 4, "k": 3, "engine": "pgvector"},
                   headers={"X-Request-Timeout": "0.000001"})
    assert_problem(r, 503, "deadline-exceeded")
    raw = np.full(4, 0.5, np.float32).tobytes()  # express's inline answers too
    r = small.post("/v1/collections/adm/search?k=3", content=raw,
                   headers={"Content-Type": "application/octet-stream", "X-Request-Timeout": "0.000001"})
    assert_problem(r, 503, "deadline-exceeded")
    r = small.post("/v1/collections/adm/search", json={"vector": [0.5] * 4, "k": 3},
                   headers={"X-Request-Timeout": "5"})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/collections/adm/search", "/v1/collections"])
def test_a_bad_timeout_header_is_400_naming_it(small, path):
    r = small.post(path, json={"vector": [0.5] * 4, "k": 3}, headers={"X-Request-Timeout": "soon"})
    assert_problem(r, 400, "bad-request", field="X-Request-Timeout")


@pytest.mark.parametrize("path", ["/v1/collections/adm/search", "/v1/collections"])
def test_a_repeated_timeout_header_is_400_naming_it(small, path):
    """Two copies of the deadline: refused, as a repeated Content-Type is, rather than the last one silently kept."""
    for copies in (["0.0001", "100"], ["100", "0.0001"], ["abc", "5"]):
        r = small.post(path, json={"vector": [0.5] * 4, "k": 3},
                       headers=[("X-Request-Timeout", copy) for copy in copies])
        assert_problem(r, 400, "bad-request", field="X-Request-Timeout")


def test_a_write_waits_for_a_connection_at_most_the_acquire_timeout(small):
    runtime = small.app.state.switchyard
    runtime.pool.acquire_timeout_s = 0.2
    held = [small.portal.call(runtime.pool.acquire) for _ in range(2)]  # every connection of the pool
    try:
        r = small.post("/v1/collections/adm/points/delete", json={"ids": [1]})
        assert_problem(r, 503, "database-busy")
        assert r.headers["Retry-After"] == "1"
    finally:
        for conn in held:
            small.portal.call(runtime.pool.release, conn)
    assert small.post("/v1/collections/adm/points/delete", json={"ids": [1]}).json()["deleted"] == 1


def test_under_a_burst_every_answer_is_200_or_503_with_retry_after(small):
    def search(i):
        r = small.post("/v1/collections/adm/search", json={"vector": [i / 64] * 4, "k": 3, "engine": "pgvector"})
        return r.status_code, r.headers.get("Retry-After")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(search, range(64)))
    statuses = {status for status, _ in answers}
    assert statuses <= {200, 503}, statuses
    assert 200 in statuses
    assert all(retry is not None and int(retry) >= 1 for status, retry in answers if status == 503)
    assert small.app.state.switchyard.admission.gates["pgvector"].active == 0


def test_request_quota_over_http(make_client):
    client = make_client(raise_server_exceptions=False, quota_requests_per_s=0.5, quota_burst=2)
    wait_ready(client)
    assert client.get("/v1/collections").status_code == 200
    assert client.get("/v1/collections").status_code == 200
    r = client.get("/v1/collections")
    assert_problem(r, 429, "quota-exceeded")
    assert int(r.headers["Retry-After"]) >= 1
    assert client.get("/healthz").status_code == 200  # probes draw on no quota


def test_operations_endpoints_can_require_the_key(make_client):
    client = make_client(raise_server_exceptions=False, api_key="k3y", ops_auth="key")
    for path in ("/metrics", "/readyz", "/healthz"):
        assert_problem(client.get(path), 401, "unauthorized")
    assert client.get("/healthz", headers={"Authorization": "Bearer k3y"}).status_code == 200
    open_client = make_client(raise_server_exceptions=False, api_key="k3y")
    assert open_client.get("/metrics").status_code == 200


def test_postgres_statements_run_under_the_deadline(small):
    import asyncpg

    runtime = small.app.state.switchyard

    async def statement_timeout(seconds, sql="SHOW statement_timeout"):
        if seconds is not None:
            set_deadline(time.monotonic() + seconds)
        async with runtime.pool.acquire() as conn:
            return await conn.fetchval(sql)

    assert small.portal.call(statement_timeout, 30) in ("30s", "29999ms", "29998ms")
    for _ in range(3):  # released connections forget it (RESET ALL), whichever comes next
        assert small.portal.call(statement_timeout, None) == "0"
    started = time.monotonic()
    with pytest.raises(asyncpg.QueryCanceledError):
        small.portal.call(statement_timeout, 0.2, "SELECT pg_sleep(5)")
    assert time.monotonic() - started < 2


def _failing_collection(make_client, name: str, error: Exception, **settings) -> tuple[Any, list[int]]:
    """A client and a 20-row collection whose resident index raises `error` on every search, and its calls."""
    client = make_client(raise_server_exceptions=False, breaker_cooldown_s=60, inline_search_us=0, **settings)
    wait_ready(client)
    client.delete(f"/v1/collections/{name}")
    assert client.post("/v1/collections", json={"name": name, "dim": 4}).status_code == 201
    rng = np.random.default_rng(1)
    client.put(f"/v1/collections/{name}/points", json={"ids": list(range(20)), "vectors": rng.random((20, 4)).tolist()})
    calls: list[int] = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise error

    client.app.state.switchyard.vectors.resident[name].index.search = broken
    return client, calls


def test_auto_routes_around_a_resident_engine_that_keeps_failing(make_client):
    client, calls = _failing_collection(make_client, "brk", RuntimeError("the engine broke"), breaker_failures=2)
    query = {"vector": [0.5] * 4, "k": 3}
    fallbacks = [client.post("/v1/collections/brk/search", json=query).json() for _ in range(4)]
    assert [f["engine"] for f in fallbacks] == ["pgvector"] * 4
    assert "failed (error id" in fallbacks[0]["fallback"] and "RuntimeError" not in fallbacks[0]["fallback"]
    assert "cooling down after 2 failures" in fallbacks[3]["fallback"]
    assert len(calls) == 2  # after two failures the engine is not tried again during the cool-down
    r = client.post("/v1/collections/brk/search", json={**query, "engine": "cpu"})
    assert_problem(r, 503, "engine-cooling-down")
    assert 'switchyard_engine_breaker_open{engine="faiss"} 1.0' in client.get("/metrics").text


def test_an_engine_out_of_memory_answers_503_and_cools_down_at_once(make_client):
    """RMM and CuPy raise MemoryError when the device is full: a clean 503 with the cool-down as Retry-After, the
    engine skipped by `auto` from the first failure, the process unharmed."""
    client, calls = _failing_collection(make_client, "oom", MemoryError(
        "std::bad_alloc: out_of_memory: CUDA error at: rmm/mr/device/cuda_memory_resource.hpp"), breaker_failures=5)
    query = {"vector": [0.5] * 4, "k": 3}
    r = client.post("/v1/collections/oom/search", json={**query, "engine": "cpu"})
    # the failure itself is out-of-memory; a request that meets the breaker already open is cooling-down
    body = r.json()
    assert r.status_code == 503 and body["type"].endswith(("out-of-memory", "engine-cooling-down")), body
    assert r.headers["Retry-After"] == "60" and "out of memory" in body["detail"] and "bad_alloc" not in body["detail"]
    r = client.post("/v1/collections/oom/search?k=3&engine=cpu", content=np.full(4, 0.5, "<f4").tobytes(),
                    headers={"Content-Type": "application/octet-stream"})
    assert_problem(r, 503, "engine-cooling-down")
    answer = client.post("/v1/collections/oom/search", json=query).json()
    assert answer["engine"] == "pgvector" and "cooling down" in answer["fallback"]
    assert len(calls) == 1  # one out-of-memory failure was enough to route around it
    assert client.get("/readyz").status_code == 200


def test_past_the_inflight_limit_requests_are_refused_before_parsing(make_client):
    client = make_client(raise_server_exceptions=False, max_inflight=4, inflight_latency_tolerance=0)  # fixed
    wait_ready(client)
    lane = client.app.express.admission.classes["light"]  # express admits, outermost
    lane.inflight = 4  # four searches being served
    r = client.post("/v1/collections/none/search", content=b"not even json")
    body = assert_problem(r, 503, "overloaded")
    assert body["reason"] == "inflight" and r.headers["Retry-After"] == "1"
    assert client.get("/readyz").status_code == 200  # probes and metrics are never refused
    assert 'switchyard_shed_total{engine="requests",reason="inflight"} 1.0' in client.get("/metrics").text
    lane.inflight = 3
    assert_problem(client.post("/v1/collections/none/search", json={"vector": [1.0], "k": 1}), 404, "not-found")
    assert lane.inflight == 3


# -- quotas keyed on verified principals, in bounded tables ------------------------------------------------

def test_rotating_authorization_values_draw_on_one_quota(make_client):
    """No key configured: the client's address is the principal; an Authorization value proves nothing and must not
    buy a fresh bucket."""
    client = make_client(raise_server_exceptions=False, quota_requests_per_s=0.1, quota_burst=2)
    statuses = [client.get("/v1/collections", headers={"Authorization": f"Bearer junk{i}"}).status_code
                for i in range(20)]
    assert statuses == [200] * 2 + [429] * 18, statuses


def test_with_a_key_the_quota_is_the_verified_keys_and_a_wrong_key_is_401_before_any(make_client):
    client = make_client(raise_server_exceptions=False, api_key="k3y", quota_requests_per_s=0.1, quota_burst=2)
    admission = client.app.state.switchyard.admission
    for i in range(20):
        assert_problem(client.get("/v1/collections", headers={"Authorization": f"Bearer junk{i}"}), 401,
                       "unauthorized")
    assert len(admission.requests) == 0  # no bucket for what was never verified
    statuses = [client.get("/v1/collections", headers={"Authorization": "Bearer k3y"}).status_code for _ in range(4)]
    assert statuses == [200, 200, 429, 429]
    assert len(admission.requests) == 1


def _get(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """One request to the app as from a unix socket (no client address), without its lifespan: its status."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "client": None, "server": None, "scheme": "http",
             "http_version": "1.1"}
    run(app(scope, receive, send))
    return sent[0]["status"]


def test_the_front_client_header_is_trusted_only_by_an_engine_behind_fronts(tmp_path):
    """X-Switchyard-Client names the client only where a front set it: an engine process behind fronts, whose HTTP
    socket only the fronts reach. Elsewhere (a unix socket of a single process) a client could rotate it."""
    from service.http.app import create_app
    from service.process.links import EngineSockets, ProcessLinks

    quota = Settings(data_dir=tmp_path, quota_requests_per_s=0.1, quota_burst=2)
    alone = create_app(quota, ProcessLinks())
    statuses = [_get(alone, "/v1/collections", [(b"x-switchyard-client", f"10.0.0.{i}".encode())]) for i in range(6)]
    assert statuses[2:] == [429] * 4, statuses
    assert len(alone.state.switchyard.admission.requests) == 1
    sockets = EngineSockets(tmp_path / "calls.sock", tmp_path / "http.sock")
    engine = create_app(quota, ProcessLinks((sockets,), serving=0))
    statuses = [_get(engine, "/v1/collections", [(b"x-switchyard-client", f"10.0.0.{i}".encode())]) for i in range(6)]
    assert 429 not in statuses, statuses  # six clients, one request each
    assert len(engine.state.switchyard.admission.requests) == 6


def test_bucket_tables_are_bounded_and_pruned(monkeypatch):
    admission = Admission(settings(quota_requests_per_s=1.0, quota_burst=2.0))
    buckets = admission.requests
    buckets.max_size = 100
    refused = 0
    for i in range(1000):
        try:
            admission.check_request(f"addr:{i}")
        except OverQuota:
            refused += 1
    assert len(buckets) <= buckets.max_size + 1
    assert refused >= 890  # the principals past the bound share one overflow bucket, not a fresh one each
    later = time.monotonic() + 10  # every bucket refilled: one back at its burst is the same as a new one
    monkeypatch.setattr(time, "monotonic", lambda: later)
    admission.check_request("addr:after")
    assert len(buckets) == 1
