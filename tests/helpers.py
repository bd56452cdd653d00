"""Small helpers shared by tests."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

PROBLEM = "application/problem+json"


def wait_ready(client: TestClient, timeout_s: float = 30.0) -> dict:
    """Poll /readyz until 200 (engines load in the background after start-up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get("/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.json()
            return r.json()
        time.sleep(0.05)


def assert_problem(response, status: int, slug: str, field: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM), response.headers["content-type"]
    body = response.json()
    assert body["status"] == status
    assert body["type"] == f"urn:switchyard:problem:{slug}", body
    assert body["title"] and body["detail"]
    if field is not None:
        assert body.get("field") == field, body
    return body
