"""Liveness, readiness before/after start-up and when the database goes away, metrics, OpenAPI."""

from __future__ import annotations

import asyncio
import re
import threading
from urllib.parse import urlsplit

from fastapi.testclient import TestClient

from conftest import _execute, fresh_database, run
from helpers import wait_ready
from service.http.app import create_app


def test_healthz_answers(client):
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_readyz_is_503_before_startup(make_settings):
    app = create_app(make_settings())
    client = TestClient(app)  # not entered: the lifespan has not run
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["checks"]["phase"] == "created"


def test_readyz_is_200_after_startup_with_every_check(client):
    body = wait_ready(client)
    assert body["checks"] == {"phase": "running", "database": "ok", "migrations": "ok", "engines": "ok"}


def test_readyz_is_503_after_shutdown(make_settings):
    app = create_app(make_settings())
    with TestClient(app) as client:
        wait_ready(client)
    runtime = app.state.switchyard
    ok, checks = asyncio.run(runtime.readiness())
    assert not ok and checks["phase"] == "stopped"


def test_readyz_is_503_when_the_database_disappears(server_dsn, make_settings):
    with fresh_database(server_dsn, "vanishing") as dsn:
        app = create_app(make_settings(database_url=dsn))
        with TestClient(app) as client:
            wait_ready(client)
            name = urlsplit(dsn).path.lstrip("/")
            run(_execute(server_dsn, f'DROP DATABASE "{name}" WITH (FORCE)'))
            r = client.get("/readyz")
            assert r.status_code == 503
            database = r.json()["checks"]["database"]
            # The readiness query failed, or the supervisor had already seen the database go (a race either way).
            assert database.startswith("unreachable") if isinstance(database, str) else database["state"] != "ok"
            assert client.get("/healthz").status_code == 200  # alive, just not ready


def test_metrics_count_requests_per_route_template_and_status(client):
    client.get("/v1/engines")
    client.get("/v1/engines")
    client.get("/no/such/route")
    text = client.get("/metrics").text
    assert 'switchyard_http_requests_total{method="GET",route="/v1/engines",status="200"} 2.0' in text
    assert 'switchyard_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert ('switchyard_http_request_duration_seconds_bucket{le="0.0005",method="GET",route="/v1/engines",'
            'status="200"}') in text
    # Engine gauges exist for every engine, whatever it can do here.
    assert 'switchyard_engine_available{domain="vectors",engine="cuvs",kind="gpu"} 0.0' in text


def test_tallied_metrics_render_exactly_what_direct_updates_would():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from service.metrics import LATENCY_BUCKETS, Metrics

    metrics, direct = Metrics(), CollectorRegistry()
    requests = Counter("switchyard_http_requests_total", "x", ["route", "method", "status"], registry=direct)
    latency = Histogram("switchyard_http_request_duration_seconds", "x", ["route", "method", "status"],
                        buckets=LATENCY_BUCKETS, registry=direct)
    # values on bucket bounds, between them and past the last
    samples = [0.0, 0.0005, 0.0007, 0.001, 0.3, 0.25, 61.0, 1e-9] * 3
    for round_ in range(2):  # folded at each collection: the second render must not count the first twice
        for i, seconds in enumerate(samples):
            status = 200 if i % 3 else 422
            metrics.observe_request("/v1/x", "POST", status, seconds)
            requests.labels("/v1/x", "POST", str(status)).inc()
            latency.labels("/v1/x", "POST", str(status)).observe(seconds)

        def lines(text: bytes, prefix: str) -> list[str]:
            return sorted(line for line in text.decode().splitlines()
                          if line.startswith(prefix) and "_created" not in line)

        for prefix in ("switchyard_http_requests_total", "switchyard_http_request_duration_seconds"):
            rendered = asyncio.run(metrics.render())
            assert lines(rendered, prefix) == lines(generate_latest(direct), prefix), (round_, prefix)


def test_a_scrape_makes_its_text_off_the_event_loop_and_reads_admission_on_it(client):
    """A scrape of a few hundred lines took 4-6 ms of prometheus_client's rendering, during which the loop
    answered nothing; admission's gauges, which may hand a slot over, must still be read on the loop."""
    from prometheus_client.registry import Collector

    seen: dict[str, int] = {}

    class Probe(Collector):
        def collect(self):
            seen["render"] = threading.get_ident()
            return iter(())

    runtime = client.app.state.switchyard
    runtime.metrics.registry.register(Probe())
    light = client.app.express.admission.classes["light"]
    current = light.current

    def on_which_thread() -> int:
        seen["admission"] = threading.get_ident()
        return current()

    light.current = on_which_thread
    try:
        client.get("/v1/engines")
        loop = client.portal.call(lambda: threading.get_ident())  # the app's event loop thread
        text = client.get("/metrics").text
    finally:
        del light.current
    assert seen["admission"] == loop and seen["render"] != loop
    assert 'switchyard_http_requests_total{method="GET",route="/v1/engines",status="200"} 1.0' in text
    assert re.search(r'^switchyard_inflight_limit\{work="light"\} \d', text, re.M)
    assert re.search(r'^switchyard_event_loop_lag_seconds \d', text, re.M)
    # the gate's share refused (on by default): none while the loop keeps up
    assert re.search(r'^switchyard_event_loop_refused_share 0\.0$', text, re.M)


def test_engine_call_metrics_record_outcome_and_latency(client):
    metrics = client.app.state.switchyard.metrics
    with metrics.engine_call("vectors", "faiss", "search"):
        pass
    try:
        with metrics.engine_call("vectors", "faiss", "search"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    text = client.get("/metrics").text
    assert ('switchyard_engine_queries_total{domain="vectors",engine="faiss",operation="search",outcome="ok"} 1.0'
            in text)
    assert ('switchyard_engine_queries_total{domain="vectors",engine="faiss",operation="search",outcome="error"} 1.0'
            in text)
    assert ('switchyard_engine_query_duration_seconds_count{domain="vectors",engine="faiss",operation="search"} 2.0'
            in text)


def test_openapi_documents_routes_and_bearer_auth_only_when_a_key_is_set(client, make_settings):
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/healthz", "/readyz", "/metrics", "/v1/engines"} <= set(spec["paths"])
    # No key configured: no route may claim to need an Authorization header.
    assert "securitySchemes" not in spec["components"]
    assert not [(p, m) for p, ops in spec["paths"].items() for m, op in ops.items() if "security" in op]

    keyed = create_app(make_settings(api_key="k", ops_auth="open")).openapi()
    assert keyed["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert keyed["paths"]["/v1/engines"]["get"]["security"] == [{"HTTPBearer": []}]
    assert "401" in keyed["paths"]["/v1/engines"]["get"]["responses"]
    assert "security" not in keyed["paths"]["/healthz"]["get"]
    guarded = create_app(make_settings(api_key="k", ops_auth="key")).openapi()
    assert guarded["paths"]["/healthz"]["get"]["security"] == [{"HTTPBearer": []}]


def test_openapi_errors_are_problem_json_and_bodies_say_what_is_accepted(make_settings):
    import jsonschema_rs

    spec = create_app(make_settings()).openapi()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for code, response in op["responses"].items():
                if int(code) >= 400 and path != "/readyz":
                    assert list(response["content"]) == ["application/problem+json"], (method, path, code)
            if path.startswith("/v1/"):
                assert {"422", "429", "503", "504"} <= set(op["responses"]), (method, path)

    def body_schema(path: str, method: str = "post") -> jsonschema_rs.Validator:
        schema = spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        return jsonschema_rs.validator_for({**schema, "components": spec["components"]})

    search = body_schema("/v1/collections/{name}/search")
    assert search.is_valid({"vector": [0, 1.5]}) and search.is_valid({"vectors": [[0.0]], "vector": None})
    assert not search.is_valid({}) and not search.is_valid({"vector": [1.0], "vectors": [[1.0]]})
    assert not search.is_valid({"vector": [True]})
    upsert = body_schema("/v1/collections/{name}/points", "put")
    assert upsert.is_valid({"ids": [1], "vectors": [[1.0]]}) and not upsert.is_valid({"ids": [1]})
    create = body_schema("/v1/collections")
    assert create.is_valid({"name": "a", "dim": 3, "pgvector_index": {"m": 8}})
    assert create.is_valid({"name": "a", "dim": 3, "pgvector_index": {"type": "ivfflat", "lists": 4}})
    assert not create.is_valid({"name": "a", "dim": 3, "pgvector_index": {"type": "none", "m": 8}})
    q12 = body_schema("/v1/olap/ssb/queries/1.2")
    assert q12.is_valid({"params": {"yearmonthnum": 199401}}) and not q12.is_valid({"params": {"yearmonthnum": 199413}})
    assert not q12.is_valid({"params": {"year": 1994}})  # Q1.3's parameter, not Q1.2's


def test_every_method_of_a_path_is_in_allow(client):
    r = client.request("PATCH", "/v1/collections")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}


def test_booleans_are_not_numbers(client):
    assert client.post("/v1/collections", json={"name": "b", "dim": True}).status_code == 422
    client.post("/v1/collections", json={"name": "b", "dim": 2})
    assert client.post("/v1/collections/b/points/delete", json={"ids": [False]}).status_code == 422
    assert client.post("/v1/collections/b/search", json={"vector": [True, 0]}).status_code == 422
    assert client.post("/v1/collections/b/search", json={"vector": [1, 0], "k": 2.0}).status_code == 200


def test_access_log_lines_come_from_a_background_thread_and_skip_hot_routes(make_settings):
    import logging

    from service.http import access_log

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[tuple[str, str]] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append((threading.current_thread().name, record.getMessage()))

    access_log.stop()
    logger = logging.getLogger("switchyard.access")
    saved = (logger.handlers, logger.propagate, logger.level)
    collect = Collect()
    logger.handlers = [collect]
    logger.setLevel(logging.INFO)  # setLevel, not .level =: it clears the logger's isEnabledFor cache
    try:
        for sample in (0.0, 1.0):
            access_log.stop()
            logger.handlers = [collect]
            with TestClient(create_app(make_settings(access_log_sample=sample))) as client:
                wait_ready(client)
                client.post("/v1/collections", json={"name": f"logged{int(sample)}", "dim": 2})
                client.put(f"/v1/collections/logged{int(sample)}/points", json={"ids": [1], "vectors": [[0, 1]]})
            access_log.stop()  # drains the queue
    finally:
        access_log.stop()
        logger.handlers, logger.propagate = saved[:2]
        logger.setLevel(saved[2])
    lines = [text for _, text in collect.lines]
    assert any('"POST /v1/collections HTTP/1.1" 201' in t for t in lines)
    puts = [t for t in lines if '"PUT /v1/collections/logged' in t]
    assert len(puts) == 1 and "logged1" in puts[0] and puts[0].endswith("(sampled)")  # only when sampled
    assert all(thread != threading.main_thread().name for thread, _ in collect.lines)
