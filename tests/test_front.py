"""The front/engine process layout: `switchyard serve --fronts 2` answers exactly as one process does.

One engine process holds the data; two front processes parse searches and upserts and pass everything else
through. Checked against a numpy oracle, with errors, auth, concurrency, metrics and process memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import httpx
import numpy as np
import orjson
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import assert_problem, raw_socket, read_response
from loadtests.processes import local_service
from service.database.postgres import EmbeddedPostgres
from service.process.front import Front
from service.process.link import EngineClient, EngineGone, EngineServer
from service.process.links import EngineSockets, ProcessLinks
from service.process.messages import CatchUp, Failure, Reply, Request, SearchCall, UnparsedCall, UpsertCall
from service.settings import Settings
from vector_data import b64, clustered, oracle, search_concurrently

DIM = 16
KEY = "front-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fronted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fronted")
    with local_service(1, folder / "data", folder / "serve.log",
                       env={"SWITCHYARD_FRONTS": "2", "SWITCHYARD_API_KEY": KEY}) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            yield client


def service_processes(client: httpx.Client) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine process and its front processes, found from the port's listener."""
    port = client.base_url.port
    listener = next(c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN")
    process = psutil.Process(listener)
    while "service.cli" not in " ".join(process.cmdline()):
        process = process.parent()
    tree = [(p, " ".join(p.cmdline())) for p in process.children(recursive=True)]
    workers = [p for p, command in tree if "spawn_main" in command]  # uvicorn's workers, when more than one
    return process, workers or [p for p, command in tree if "service.process.front" in command]


def test_answers_match_the_oracle_through_every_encoding(fronted):
    data = clustered(300, DIM, seed=11)
    assert fronted.post("/v1/collections", json={"name": "f1", "dim": DIM}).status_code == 201
    # half as JSON lists, half as base64, through the fronts' express; payloads ride along
    r = fronted.put("/v1/collections/f1/points", json={"ids": list(range(150)), "vectors": data[:150].tolist(),
                                                       "payloads": [{"i": i} for i in range(150)]})
    assert r.status_code == 200, r.text
    r = fronted.put("/v1/collections/f1/points", json={"ids": list(range(150, 300)), "vectors_b64": b64(data[150:])})
    assert r.json()["upserted"] == 150
    seq = r.json()["seq"]
    queries = clustered(5, DIM, seed=12)
    truth, distances = oracle(data, queries, 7, "l2")
    for i, q in enumerate(queries):
        r = fronted.post("/v1/collections/f1/search", json={"vector": q.tolist(), "k": 7, "consistency": "session",
                                                            "seq": seq})
        assert r.status_code == 200, r.text
        assert r.json()["ids"] == truth[i].tolist()
        assert np.allclose(r.json()["distances"], distances[i], atol=1e-4)
    batch = fronted.post("/v1/collections/f1/search", json={"vectors_b64": b64(queries), "k": 7})
    assert batch.json()["ids"] == truth.tolist()
    raw = fronted.post("/v1/collections/f1/search?k=7", content=queries[0].astype("<f4").tobytes(),
                       headers={"Content-Type": "application/octet-stream"})
    assert raw.json()["ids"] == truth[0].tolist()
    filtered = fronted.post("/v1/collections/f1/search", json={"vector": queries[0].tolist(), "k": 3,
                                                               "filter": {"i": int(truth[0][1])}})
    assert filtered.json()["ids"] == [int(truth[0][1])]


def test_errors_are_the_engines_own(fronted):
    assert fronted.post("/v1/collections", json={"name": "f2", "dim": DIM}).status_code == 201
    assert_problem(fronted.post("/v1/collections/f2/search", json={"vector": [1.0, 2.0]}), 422, "validation-error",
                   "vector")
    assert_problem(fronted.post("/v1/collections/none/search", json={"vector": [0.0] * DIM}), 404, "not-found")
    assert_problem(fronted.post("/v1/collections/f2/search", json={"vector": [0.0] * DIM, "k": 0}), 422,
                   "validation-error", "k")
    assert_problem(fronted.put("/v1/collections/f2/points", json={"ids": [1, 1], "vectors": [[0.0] * DIM] * 2}),
                   422, "validation-error", "ids")
    raw = fronted.post("/v1/collections/f2/search", content=b"\x00" * 10,
                       headers={"Content-Type": "application/octet-stream"})
    assert_problem(raw, 422, "validation-error", "body")
    no_key = httpx.post(f"{fronted.base_url}/v1/collections/f2/search", json={"vector": [0.0] * DIM})
    assert_problem(no_key, 401, "unauthorized")
    # nothing of the rejected writes was stored
    assert fronted.get("/v1/collections/f2").json()["count"] == 0


def test_concurrent_clients_share_one_engine(fronted):
    data = clustered(400, DIM, seed=21)
    assert fronted.post("/v1/collections", json={"name": "f3", "dim": DIM}).status_code == 201
    seq = fronted.put("/v1/collections/f3/points",
                      json={"ids": list(range(400)), "vectors": data.tolist()}).json()["seq"]
    queries = clustered(64, DIM, seed=22)
    truth, _ = oracle(data, queries, 5, "l2")

    assert search_concurrently(fronted, "f3", queries, 5, seq, threads=16) == truth.tolist()
    replicas = fronted.get("/v1/collections/f3").json()["replication"]["replicas"]
    assert len(replicas) == 1, replicas  # one resident copy, whatever the number of fronts
    metrics = fronted.get("/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("switchyard_http_requests_total")
                and 'route="/v1/collections/{name}/search"' in m and 'status="200"' in m)
    assert float(line.rsplit(" ", 1)[1]) >= len(queries)


def test_fronts_hold_no_data(fronted):
    engine, fronts = service_processes(fronted)
    assert len(fronts) == 2
    before = [p.memory_info().rss for p in fronts]
    data = clustered(40_000, 128, seed=31)
    assert fronted.post("/v1/collections", json={"name": "f4", "dim": 128}).status_code == 201
    engine_before = engine.memory_info().rss
    for start in range(0, len(data), 2_000):
        r = fronted.put("/v1/collections/f4/points", json={"ids": list(range(start, start + 2_000)),
                                                           "vectors_b64": b64(data[start:start + 2_000])})
        assert r.status_code == 200, r.text
    after = [p.memory_info().rss for p in fronts]
    # 40,000 x 128 float32 is 20 MB: the engine holds it; a front keeps at most what its allocator retains of the
    # 1.4 MB bodies it parsed (a few MB, however many it parsed), far under half of it
    assert engine.memory_info().rss - engine_before > 10e6
    assert all(a - b < 10e6 for a, b in zip(after, before)), (before, after)


def _echo(body: bytes, delay: float = 0.0) -> UnparsedCall:
    """A call the echo server answers with its body after `delay` seconds."""
    return UnparsedCall(True, "echo", body, "", str(delay))


async def _echo_server(path: Path) -> EngineServer:
    async def echo(request: Request) -> Reply:
        await asyncio.sleep(float(request.call.query))
        return Reply(request.id, body=request.call.body)

    async def fail(request: Request) -> Reply:
        raise ValueError("bad")

    server = EngineServer(path, {UnparsedCall: echo, CatchUp: fail})
    await server.start()
    return server


def test_engine_link_answers_out_of_order_and_reports_failures(tmp_path):
    async def run() -> None:
        server = await _echo_server(tmp_path / "e.sock")
        client = EngineClient(tmp_path / "e.sock")
        try:
            slow = asyncio.create_task(client.call(_echo(b"slow", 0.2)))
            fast = await client.call(_echo(b"fast"))
            assert fast.body == b"fast" and not slow.done()  # answers come back as they finish
            assert (await slow).body == b"slow"
            big = np.arange(1_000_000, dtype=np.float32).tobytes()
            assert (await client.call(_echo(big))).body == big
            failed = await client.call(CatchUp("c", 1))  # the handler raised: a 500 naming the failure
            assert failed.status == 500 and failed.value == Failure("EngineFailed", "ValueError: bad")
            pending = asyncio.create_task(client.call(_echo(b"late", 5.0)))
            await asyncio.sleep(0.05)
            await server.stop()
            with pytest.raises(EngineGone):
                await pending
            with pytest.raises(EngineGone):
                await client.call(_echo(b"x"))
            server = await _echo_server(tmp_path / "e.sock")  # the engine is back: the client reconnects
            assert (await client.call(_echo(b"again"))).body == b"again"
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())


def test_fronts_stop_with_the_engine(tmp_path):
    with local_service(1, tmp_path / "data", tmp_path / "serve.log", env={"SWITCHYARD_FRONTS": "1"}) as url:
        with httpx.Client(base_url=url) as client:
            engine, fronts = service_processes(client)
        assert len(fronts) == 1
        engine.send_signal(signal.SIGKILL)  # no clean shutdown: the fronts must not outlive it
        deadline = time.monotonic() + 20
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in fronts):
            assert time.monotonic() < deadline, "front processes outlived the engine"
            time.sleep(0.2)
    orphan = EmbeddedPostgres(tmp_path / "data" / "postgres")  # the killed engine's server: stop it
    orphan.start()
    orphan.stop()


def test_a_tcp_engine_link_signs_its_frames_and_never_decodes_a_forged_one(tmp_path):
    """The shard hosts' direct channel: TCP, frames signed with a key that only the placing layer hands out."""
    handled: list[bytes] = []

    async def run() -> None:
        async def echo(request: Request) -> Reply:
            handled.append(request.call.body)
            return Reply(request.id, body=request.call.body)

        key = b"k" * 32
        server = EngineServer(("127.0.0.1", 0), {UnparsedCall: echo}, key=key)
        await server.start()
        good = EngineClient(("127.0.0.1", server.port), key)
        forged = EngineClient(("127.0.0.1", server.port), b"x" * 32)
        try:
            assert (await good.call(_echo(b"hi"))).body == b"hi"
            with pytest.raises(EngineGone):  # the server closes the connection without answering
                await asyncio.wait_for(forged.call(_echo(b"forged")), 5)
            assert (await good.call(_echo(b"still"))).body == b"still"
            assert handled == [b"hi", b"still"]
        finally:
            await good.close()
            await forged.close()
            await server.stop()

    asyncio.run(run())


def test_through_a_front_a_failure_is_a_problem_on_a_kept_connection(fronted):
    """A payload integer past 64 bits failed in the front's parse step, which nothing caught: uvicorn answered plain
    text and dropped the connection. Whatever it is answered now, it is a problem, on a connection that goes on."""
    assert fronted.post("/v1/collections", json={"name": "f5", "dim": 2}).status_code == 201
    body = b'{"ids": [1], "vectors": [[1.0, 2.0]], "payloads": [{"n": 123456789012345678901234567890}]}'
    upsert = (f"PUT /v1/collections/f5/points HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    sock = raw_socket(fronted.base_url)
    try:
        sock.sendall(upsert)
        status, headers, answer = read_response(sock)
        assert status in (422, 500) and headers["content-type"] == "application/problem+json", answer
        sock.sendall(f"GET /v1/collections/f5 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        status, _, answer = read_response(sock)
        assert status == 200 and orjson.loads(answer)["count"] == 0
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def front_before(folder: Path,
                       handler: Callable[[Request], Awaitable[Reply]]) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a Front (over ASGI) whose engine answers its hot calls with `handler` over a real link."""
    calls = folder / "calls.sock"
    server = EngineServer(calls, dict.fromkeys((SearchCall, UpsertCall, UnparsedCall), handler))
    await server.start()
    front = Front(Settings(data_dir=folder), ProcessLinks((EngineSockets(calls, folder / "http.sock"),)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(front), base_url="http://front") as client:
            yield client
    finally:
        await front.engines[0].close()
        await server.stop()


def test_a_front_answers_an_engine_side_failure_as_a_problem(tmp_path, monkeypatch):
    """An engine whose handler raises, and a front whose own parse step raises: each a 500 problem with an error id
    (not 503 engine-unavailable, not the server's plain text)."""
    async def broken(request: Request) -> Reply:
        raise RuntimeError("an engine bug")

    async def go() -> None:
        async with front_before(tmp_path, broken) as client:
            r = await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]})
            assert assert_problem(r, 500, "internal-error")["error_id"]
            assert "engine bug" not in r.text
            monkeypatch.setattr("service.http.express.parse_call", lambda *args: 1 / 0)
            r = await client.put("/v1/collections/c/points", json={"ids": [1], "vectors": [[1.0, 2.0]]})
            assert assert_problem(r, 500, "internal-error")["error_id"]

    asyncio.run(go())


def test_a_front_refuses_itself_most_of_what_an_overloaded_engine_would_refuse(tmp_path):
    """While the engine refuses searches as overloaded, the front refuses most of them itself (503 overloaded with
    Retry-After, reason "throttled"), so the engine's core no longer pays for each refusal; upserts, which the
    engine accepts, are never refused by the front."""
    from service.admission.control import Shed
    from service.pipeline import problem_reply_of

    seen = {"search": 0, "upsert": 0, "throttled": 0}

    async def overloaded(request: Request) -> Reply:
        search = isinstance(request.call, SearchCall)
        seen["search" if search else "upsert"] += 1
        seen["throttled"] += request.refused.get("throttled", 0)  # told with the next call
        if search:
            reply = problem_reply_of(Shed("no room", 1.0, reason="inflight", work_class="light"), "/x")
        else:
            reply = Reply(0, 200, b'{"upserted": 1}')
        reply.id = request.id
        return reply

    async def go() -> None:
        async with front_before(tmp_path, overloaded) as client:
            answers = [await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]}) for _ in range(200)]
            upserts = [await client.put("/v1/collections/c/points", json={"ids": [i], "vectors": [[1.0, 2.0]]})
                       for i in range(50)]
        assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in answers)
        throttled = [assert_problem(r, 503, "overloaded") for r in answers if "throttled" in r.text]
        assert len(throttled) == 200 - seen["search"] and all(p["reason"] == "throttled" for p in throttled)
        assert seen["search"] < 50  # the engine saw a few of them, not all 200
        assert [r.status_code for r in upserts] == [200] * 50 and seen["upsert"] == 50
        assert seen["throttled"] == len(throttled)

    asyncio.run(go())


@contextlib.asynccontextmanager
async def front_over_tcp(folder: Path, handler: Callable[[Request], Awaitable[Reply]], engine_http: object = None,
                         **settings: object) -> AsyncIterator[tuple[Front, httpx.AsyncClient]]:
    """A Front served by uvicorn with the express protocol on a TCP port (its lifespan off: nothing started),
    whose engine answers its hot calls with `handler` over a real link and, given `engine_http` (an ASGI app), what
    the front passes through on the engine's HTTP socket; and a keep-alive client holding the key."""
    import uvicorn

    from service.http.express_protocol import ExpressProtocol

    calls, http = folder / "calls.sock", folder / "http.sock"
    engine = EngineServer(calls, dict.fromkeys((SearchCall, UpsertCall, UnparsedCall), handler))
    await engine.start()
    front = Front(Settings(data_dir=folder, api_key=KEY, **settings),  # type: ignore[arg-type]
                  ProcessLinks((EngineSockets(calls, http),)))
    servers = [uvicorn.Server(uvicorn.Config(front, host="127.0.0.1", port=0, http=ExpressProtocol, lifespan="off",
                                             log_level="warning"))]
    if engine_http is not None:
        servers.append(uvicorn.Server(uvicorn.Config(engine_http, uds=str(http), lifespan="off", log_level="warning")))
    serving = [asyncio.create_task(server.serve()) for server in servers]
    try:
        while not all(server.started for server in servers):
            await asyncio.sleep(0.01)
        port = servers[0].servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH) as client:
            yield front, client
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*serving)
        await front.engines[0].close()
        await engine.stop()


def test_over_tcp_a_front_refuses_from_the_headers_and_never_runs_what_it_refuses(tmp_path, monkeypatch):
    """Through the express protocol, the throttle refuses a search from its headers, once its body is read: the
    app's way (an ASGI cycle, the JSON parsed, InEngineProcess.run) costs the front about eight times the CPU and is
    taken only by the searches sent on, which are not drawn for again there. A client without the key still gets
    401 from the app, however much the front refuses."""
    from service.admission.control import Shed
    from service.pipeline import problem_reply_of
    from service.process.front import InEngineProcess

    seen = {"search": 0, "throttled": 0, "runs": 0}
    run = InEngineProcess.run

    async def counted_run(self, call, spent_s, scope):
        seen["runs"] += 1
        return await run(self, call, spent_s, scope)

    monkeypatch.setattr(InEngineProcess, "run", counted_run)

    async def overloaded(request: Request) -> Reply:
        seen["search"] += 1
        seen["throttled"] += request.refused.get("throttled", 0)
        reply = problem_reply_of(Shed("no room", 1.0, reason="inflight", work_class="light"), "/x")
        reply.id = request.id
        return reply

    async def go() -> None:
        async with front_over_tcp(tmp_path, overloaded) as (front, client):
            answers = [await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]})
                       for _ in range(200)]
            keyless = await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]},
                                        headers={"Authorization": ""})
            refusing = front.calls.throttles[front.engines[0]]["light"].share()
        throttled = [assert_problem(r, 503, "overloaded") for r in answers if "throttled" in r.text]
        assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in answers)
        assert len(throttled) > 150 and all(p["reason"] == "throttled" for p in throttled)
        assert seen["runs"] == seen["search"] < 60  # run only for the searches sent on: none of them refused there
        assert_problem(keyless, 401, "unauthorized")
        assert refusing > 0.5  # it was refusing when the key was missed

    asyncio.run(go())


def test_a_front_throttles_what_it_passes_through_by_work_class(tmp_path):
    """Requests passed through over HTTP (SSB queries here) are throttled as hot calls are, by the work class the
    engine admits them in: while the engine refuses heavy work as overloaded, the front refuses most of it itself
    from the headers (reason throttled, work_class heavy), and the engine sees a few; light requests, which the
    engine accepts, are never refused; and the engine is told the front's refusals on the requests passed through."""
    from service.admission.control import Shed
    from service.http.express import REFUSED_HEADER, refused_counts
    from service.pipeline import problem_reply_of

    seen = {"heavy": 0, "light": 0, "told": 0}

    async def engine_http(scope, receive, send) -> None:  # the engine's app: its heavy class full
        while (await receive()).get("more_body"):
            pass
        told = dict(scope["headers"]).get(REFUSED_HEADER)
        seen["told"] += refused_counts(told).get("throttled", 0) if told else 0
        if scope["path"].startswith("/v1/olap/"):
            seen["heavy"] += 1
            reply = problem_reply_of(Shed("no room", 1.0, reason="inflight", work_class="heavy"), scope["path"])
        else:
            seen["light"] += 1
            reply = Reply(0, 200, b"[]", [("content-type", "application/json")])
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(k.encode(), v.encode()) for k, v in reply.headers]})
        await send({"type": "http.response.body", "body": reply.body})

    async def unused(request: Request) -> Reply:
        raise AssertionError("no hot call is sent")

    async def go() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with front_over_tcp(tmp_path, unused, engine_http) as (_, client):
            heavy = [await client.post("/v1/olap/ssb/queries/1.1", json={"engine": "duckdb"}) for _ in range(200)]
            light = [await client.get("/v1/collections") for _ in range(50)]
        return heavy, light

    heavy, light = asyncio.run(go())
    throttled = [assert_problem(r, 503, "overloaded") for r in heavy if "throttled" in r.text]
    assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in heavy)
    assert len(throttled) > 150 and all(p["work_class"] == "heavy" for p in throttled)
    assert seen["heavy"] == 200 - len(throttled) < 60
    assert [r.status_code for r in light] == [200] * 50 and seen["light"] == 50
    assert seen["told"] == len(throttled)  # the light requests carried the last of them


def test_a_front_whose_event_loop_runs_behind_refuses_a_share_from_the_headers(tmp_path):
    """A front's own backlog is bounded as the engine's is (service/admission/loop_lag.py): once its event loop has
    stood behind the target past the burst allowance, the share the gate sets of /v1 requests is refused from their
    headers (503 overloaded, reason loop_lag, Retry-After), spread evenly, and the engine counts those refusals with
    the next call; a keyless request still gets 401. With the target 0, nothing is refused however far behind."""
    seen = {"search": 0, "loop_lag": 0}

    async def answering(request: Request) -> Reply:
        seen["search"] += 1
        seen["loop_lag"] += request.refused.get("loop_lag", 0)
        return Reply(request.id, 200, b'{"ids": [], "distances": []}')

    async def go(target_ms: float) -> tuple[list[httpx.Response], httpx.Response, float]:
        async with front_over_tcp(tmp_path, answering, loop_lag_target_ms=target_ms) as (front, client):
            for _ in range(6):  # 20 ms behind a 2 ms target: the burst allowance used up, then a share refused
                front.loop_lag.observe(0.02)
            share = front.loop_lag.share
            answers = [await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]})
                       for _ in range(100)]
            keyless = await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]},
                                        headers={"Authorization": ""})
            while front.loop_lag.share:  # caught up: the next call carries the last refusals to the engine
                front.loop_lag.observe(0.0)
            assert (await client.post("/v1/collections/c/search", json={"vector": [1.0, 2.0]})).status_code == 200
            assert front.loop_lag.arrived == 102  # every request, refused or not, arrived for the gate
        return answers, keyless, share

    answers, keyless, share = asyncio.run(go(2.0))
    refused = [assert_problem(r, 503, "overloaded") for r in answers if r.status_code != 200]
    assert 0.3 < share < 1 and abs(len(refused) - 100 * share) <= 1, (share, len(refused))
    assert all(p["reason"] == "loop_lag" and "front process" in p["detail"] for p in refused)
    assert all(r.headers["retry-after"] == "1" for r in answers if r.status_code == 503)
    assert seen["loop_lag"] == len(refused) and seen["search"] == 100 - len(refused) + 1
    assert_problem(keyless, 401, "unauthorized")
    seen.update(search=0, loop_lag=0)
    answers, _, share = asyncio.run(go(0.0))
    assert share == 0 and [r.status_code for r in answers] == [200] * 100 and seen["loop_lag"] == 0


def test_an_engine_refuses_a_call_it_has_no_room_for_as_it_arrives_without_running_its_handler(tmp_path):
    """A front's call that finds its work class without a free slot or room to wait is refused by the engine as its
    frame arrives (503 overloaded, reason inflight, Retry-After), without a task or its handler: under overload the
    engine still refuses about one call in three that the fronts send it (throttle.K). The front's own refusals it
    carries are counted all the same, and every call as one request arrived (loop_lag.py); once there is room, calls
    are run again."""
    from service.admission.pressure import LIGHT
    from service.http.app import create_app
    from service.process.engine_host import engine_server

    async def go() -> None:
        app = create_app(Settings(data_dir=tmp_path, max_inflight=4))
        runtime = app.state.switchyard
        server = engine_server(runtime, runtime.pipeline, tmp_path / "e.sock")
        handled: list[int] = []
        handle = server.handlers[SearchCall]

        async def counted(request: Request) -> Reply:
            handled.append(request.id)
            return await handle(request)

        server.handlers = dict.fromkeys(server.handlers, counted)
        light = runtime.admission.classes[LIGHT]
        light.inflight = light.limit
        light.waiters.extend(asyncio.get_running_loop().create_future() for _ in range(2 * light.limit))
        await server.start()
        client = EngineClient(tmp_path / "e.sock")
        call = SearchCall("c", np.zeros(2, "<f4").tobytes(), 2, "vector", True)
        try:
            refused = [await client.call(call, refused={"throttled": 2}) for _ in range(5)]
            light.inflight = 0
            light.waiters.clear()
            await client.call(call)
        finally:
            await client.close()
            await server.stop()
        for reply in refused:
            problem = orjson.loads(reply.body)
            assert reply.status == 503 and ("retry-after", "1") in reply.headers, reply
            assert problem["reason"] == "inflight" and problem["instance"] == "/v1/collections/c/search", problem
        assert len(handled) == 1  # only the call made once there was room
        shed = {s.labels["reason"]: s.value for family in text_string_to_metric_families(
            (await runtime.metrics.render()).decode()) if family.name == "switchyard_shed"
            for s in family.samples if s.name == "switchyard_shed_total" and s.labels["engine"] == "requests"}
        assert shed["throttled"] == 10 and shed["inflight"] == 5, shed
        assert runtime.admission.loop_lag.arrived == 6  # each call, refused or run, arrived for the loop's lag gate

    asyncio.run(go())


def test_a_front_tells_its_engine_its_refusals_on_requests_passed_through_too(tmp_path):
    """A front's refusals reach its engine's metrics on whatever goes to it next: a hot call's frame, or a request
    passed through over HTTP (X-Switchyard-Refused), so that a front passing through only SSB queries is counted
    too. The header is the front's alone (a client's own is dropped) and counted only by an engine behind fronts,
    for the reasons a front refuses for."""
    from service.admission.control import Shed
    from service.http.app import create_app
    from service.http.express import REFUSED_HEADER

    front = Front(Settings(data_dir=tmp_path), ProcessLinks((EngineSockets(tmp_path / "c.sock", tmp_path / "h.sock"),)))
    engine, proxy = front.engines[0], front.proxies[0]
    for reason in ("loop_lag", "throttled", "loop_lag"):
        front.calls.refuse(engine, Shed("busy", 1.0, reason=reason), "/v1/olap/ssb/queries/1.1")
    scope = {"headers": [(b"host", b"t"), (REFUSED_HEADER, b"throttled=1000")], "client": ("10.1.2.3", 5)}
    sent = proxy.headers(scope)
    assert [v for k, v in sent if k == REFUSED_HEADER] == [b"loop_lag=2,throttled=1"]
    assert REFUSED_HEADER not in dict(proxy.headers(scope))  # told once; the client's own never
    assert front.calls.unreported[engine] == {}

    def shed_after(app, value: bytes) -> dict[str, float]:
        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            pass

        async def go() -> bytes:
            await app({"type": "http", "method": "GET", "path": "/v1/collections", "raw_path": b"/v1/collections",
                       "root_path": "", "query_string": b"", "headers": [(REFUSED_HEADER, value)], "client": None,
                       "server": None, "scheme": "http", "http_version": "1.1"}, receive, send)
            return await app.state.switchyard.metrics.render()

        return {s.labels["reason"]: s.value for family in text_string_to_metric_families(asyncio.run(go()).decode())
                if family.name == "switchyard_shed" for s in family.samples
                if s.name == "switchyard_shed_total" and s.labels["engine"] == "requests" and s.value}

    value = b"loop_lag=2,throttled=1,inflight=7,quota=x,bogus"
    links = ProcessLinks((EngineSockets(tmp_path / "c.sock", tmp_path / "h.sock"),), serving=0)  # behind fronts
    assert shed_after(create_app(Settings(data_dir=tmp_path / "e"), links), value) == {"loop_lag": 2, "throttled": 1}
    assert shed_after(create_app(Settings(data_dir=tmp_path / "a"), ProcessLinks()), value) == {}


def test_under_overload_through_a_front_every_refusal_is_a_documented_503_counted_in_metrics(tmp_path):
    """A real `serve` with one front and an engine of one light slot, searched by 32 clients at once: each answer is
    200 or a 503 `overloaded` with Retry-After whose reason is the engine's (`inflight`) or the front's own
    (`throttled`, when the engine refused enough of them: test_a_front_refuses_itself... makes sure it does; or
    `loop_lag`, a loop behind), and /metrics counts exactly the refusals the clients saw, of each reason."""
    from concurrent.futures import ThreadPoolExecutor

    env = {"SWITCHYARD_FRONTS": "1", "SWITCHYARD_MAX_INFLIGHT": "1", "SWITCHYARD_MIN_INFLIGHT": "1",
           "SWITCHYARD_INFLIGHT_LATENCY_TOLERANCE": "0"}
    with local_service(1, tmp_path / "data", tmp_path / "serve.log", env=env) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/collections", json={"name": "busy", "dim": DIM}).status_code == 201
            data = clustered(500, DIM, seed=3)
            assert client.put("/v1/collections/busy/points", json={"ids": list(range(500)),
                                                                   "vectors": data.tolist()}).status_code == 200

            def searches(seed: int) -> list[httpx.Response]:
                queries = np.random.default_rng(seed).random((60, DIM))
                with httpx.Client(base_url=url, timeout=60) as own:
                    return [own.post("/v1/collections/busy/search", json={"vector": q.tolist(), "k": 10})
                            for q in queries]

            with ThreadPoolExecutor(32) as pool:
                answers = [r for part in pool.map(searches, range(32)) for r in part]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the front may still refuse a share for a while: until one is
                answers.append(client.post("/v1/collections/busy/search", json={"vector": data[0].tolist()}))
                if answers[-1].status_code == 200:  # answered (it carried the front's last refusals to the engine)
                    break
                time.sleep(0.1)
            assert answers[-1].status_code == 200, answers[-1].text
            metrics = client.get("/metrics").text
    reasons: dict[str, int] = {}
    for r in answers:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            problem = assert_problem(r, 503, "overloaded")
            assert r.headers["retry-after"] == "1", problem
            assert problem["reason"] in ("inflight", "throttled", "loop_lag"), problem
            reasons[problem["reason"]] = reasons.get(problem["reason"], 0) + 1
    counted = {s.labels["reason"]: int(s.value) for family in text_string_to_metric_families(metrics)
               if family.name == "switchyard_shed" for s in family.samples
               if s.name == "switchyard_shed_total" and s.labels["engine"] == "requests"}
    assert {reason: n for reason, n in counted.items() if n} == reasons
