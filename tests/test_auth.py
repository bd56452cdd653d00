"""With SWITCHYARD_API_KEY set, every /v1 route needs the bearer token; probes and metrics never do."""

from __future__ import annotations

from helpers import assert_problem

KEY = "s3cret-key"


def test_without_a_key_v1_is_open(client):
    assert client.get("/v1/engines").status_code == 200


def test_missing_token_is_401_with_challenge(make_client):
    client = make_client(api_key=KEY)
    r = client.get("/v1/engines")
    assert_problem(r, 401, "unauthorized", "Authorization")
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_wrong_token_and_wrong_scheme_are_401(make_client):
    client = make_client(api_key=KEY)
    assert_problem(client.get("/v1/engines", headers={"Authorization": "Bearer nope"}), 401, "unauthorized")
    assert_problem(client.get("/v1/engines", headers={"Authorization": f"Basic {KEY}"}), 401, "unauthorized")


def test_right_token_passes(make_client):
    client = make_client(api_key=KEY)
    assert client.get("/v1/engines", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_probes_docs_and_metrics_need_no_token(make_client):
    client = make_client(api_key=KEY)
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert client.get(path).status_code in (200, 503), path
