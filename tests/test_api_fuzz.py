"""Property-based requests from the OpenAPI schema (schemathesis): whatever a client sends, the service answers
without a 5xx. Generating and importing SSB data are left out (a random scale factor is a long job), as is the
GeoParquet upload (schemathesis cannot write Parquet)."""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from helpers import wait_ready
from service.app import create_app


@pytest.fixture(scope="module")
def api_schema(database_url, tmp_path_factory):
    from service.settings import Settings

    app = create_app(Settings(database_url=database_url, data_dir=tmp_path_factory.mktemp("fuzz")))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client)
        client.post("/v1/collections", json={"name": "c", "dim": 4})
        client.put("/v1/collections/c/points", json={"ids": [1, 2, 3], "vectors": [[0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]]})
        yield schemathesis.openapi.from_asgi("/openapi.json", app).exclude(
            path_regex=r"olap/ssb/(generate|import)").exclude(method="PUT", path_regex=r"spatial/layers")


def test_no_request_makes_the_service_fail(api_schema):
    failures, calls = [], []
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(operation.as_strategy())
        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:
            response = case.call()
            calls.append(case.path)
            not_ready = case.path == "/readyz" and response.status_code == 503
            if response.status_code >= 500 and not not_ready:
                failures.append((case.method, case.path, response.status_code, response.text[:300]))

        check()
    assert len(set(calls)) >= 15 and len(calls) >= 100, (len(set(calls)), len(calls))  # it really ran
    assert not failures, failures
