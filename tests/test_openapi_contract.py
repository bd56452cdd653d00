"""The OpenAPI document says what the service does: only JSON Schema keywords in its schemas, a body the schema
takes is not refused for that field (and one it refuses is a 422), and links from what creates a resource to the
operations on it, which a stateful checker follows."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest

from helpers import wait_ready

# JSON Schema 2020-12 and OpenAPI 3.1's own schema keywords. pydantic writes constraints it cannot place as its
# own names ("ge", "le", "max_length"...), which validators ignore: a body the document calls valid gets a 422.
SCHEMA_KEYWORDS = {
    "$ref", "$defs", "$schema", "$id", "$anchor", "$comment", "type", "enum", "const", "properties", "required",
    "additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "items", "prefixItems", "contains", "minContains", "maxContains",
    "minItems", "maxItems", "uniqueItems", "unevaluatedItems", "unevaluatedProperties", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
    "contentMediaType", "contentEncoding", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "title",
    "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly", "discriminator", "xml",
    "externalDocs",
}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties")


def _foreign_keywords(schema: Any, where: str) -> list[str]:
    if not isinstance(schema, dict):
        return []
    found = [f"{where}/{key}" for key in schema if key not in SCHEMA_KEYWORDS and not key.startswith("x-")]
    for key in SUBSCHEMA_MAPS:
        for name, sub in schema.get(key, {}).items():
            found += _foreign_keywords(sub, f"{where}/{key}/{name}")
    for key in SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key, [])):
            found += _foreign_keywords(sub, f"{where}/{key}/{i}")
    for key in SUBSCHEMAS:
        if key in schema:
            found += _foreign_keywords(schema[key], f"{where}/{key}")
    return found


def _schemas(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every schema the document holds: components, request bodies, parameters, responses and their headers."""
    out = [(f"components/schemas/{name}", s) for name, s in doc.get("components", {}).get("schemas", {}).items()]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            at = f"{method.upper()} {path}"
            for p in op.get("parameters", []):
                out.append((f"{at} parameter {p['name']}", p.get("schema")))
            for media, content in op.get("requestBody", {}).get("content", {}).items():
                out.append((f"{at} body {media}", content.get("schema")))
            for status, response in op.get("responses", {}).items():
                for media, content in response.get("content", {}).items():
                    out.append((f"{at} {status} {media}", content.get("schema")))
                for name, header in response.get("headers", {}).items():
                    out.append((f"{at} {status} header {name}", header.get("schema")))
    return out


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    from service.http.app import create_app
    from service.settings import Settings

    app = create_app(Settings(database_url="postgresql://nobody@127.0.0.1:1/none"))  # the document needs no database
    return app.openapi()


def test_the_document_has_only_json_schema_keywords(doc):
    found = [f for where, schema in _schemas(doc) for f in _foreign_keywords(schema, where)]
    assert found == []


def test_the_walk_finds_what_pydantic_leaves_behind():
    bad = {"anyOf": [{"type": "integer", "ge": 1, "le": 5}, {"type": "null"}]}
    assert _foreign_keywords({"properties": {"ge": {"type": "integer"}, "lists": bad}}, "s") == [
        "s/properties/lists/anyOf/0/ge", "s/properties/lists/anyOf/0/le"]


def _body_validator(doc: dict[str, Any], path: str, method: str) -> jsonschema.Draft202012Validator:
    schema = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


SSB = "/v1/olap/ssb/queries/{}"
# (path, method, body, what the schema says of it, the field at fault when it is refused)
CASES = [
    ("/v1/collections", "post", {"name": "ivf0", "dim": 4, "pgvector_index": {"type": "ivfflat", "lists": 0}},
     False, "pgvector_index.lists"),
    ("/v1/collections", "post", {"name": "ivf1", "dim": 4, "pgvector_index": {"type": "ivfflat", "lists": 1}},
     True, None),
    ("/v1/collections", "post", {"name": "hnsw1", "dim": 4, "pgvector_index": {"m": 101}}, False, "pgvector_index.m"),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "k": 5.0}, True, None),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "consistency": "session", "seq": -1},
     False, "seq"),
    ("/v1/collections/{name}/search", "post", {"vectors": []}, False, "vectors"),
    # numbers are JSON numbers: not strings, not booleans; recall targets within (0, 1]
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "k": "3"}, False, "k"),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "params": {"ef": "64"}}, False, "params.ef"),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "recall_target": True}, False,
     "recall_target"),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "recall_target": 5}, False, "recall_target"),
    ("/v1/collections/{name}/search", "post", {"vector": [0, 0, 0, 1], "recall_target": 1}, True, None),
    ("/v1/collections/{name}/recall", "post", {"sample": 2, "recall_target": "0.5"}, False, "recall_target"),
    ("/v1/collections/{name}/recall", "post", {"sample": 2, "seed": "1"}, False, "seed"),
    ("/v1/collections/{name}/recall", "post", {"sample": 2, "params": {"ef": True}}, False, "params.ef"),
    ("/v1/collections/{name}/points/delete", "post", {"ids": ["1"]}, False, "ids"),
    ("/v1/collections", "post", {"name": "strk", "dim": 4, "index": {"type": "hnsw", "params": {"m": "8"}}}, False,
     "index.params.m"),
    ("/v1/collections/{name}/points/delete", "post", {"ids": [1, 1]}, False, "ids"),
    ("/v1/collections/{name}/points/delete", "post", {"ids": [1.0, 2]}, True, None),
    ("/v1/collections/{name}/points", "put", {"ids": [7, 7], "vectors": [[0, 0, 0, 1], [0, 0, 1, 0]]}, False, "ids"),
    ("/v1/collections/{name}/points", "put", {"ids": [7], "vectors": []}, False, "vectors"),
    ("/v1/collections/{name}/recall", "post", {"queries": []}, False, "queries"),
    ("/v1/spatial/layers", "post", {"name": "w", "kind": "polygons", "wkb_b64": []}, False, "wkb_b64"),
    ("/v1/spatial/layers", "post", {"name": "w", "kind": "polygons", "wkt": []}, False, "wkt"),
    ("/v1/spatial/layers", "post", {"name": "d", "kind": "points", "lon": [1, 2], "lat": [1, 2], "ids": [3, 3]},
     False, "ids"),
    (SSB.format("4.2"), "post", {"engine": "duckdb", "params": {"years": [1997.0, 1998]}}, True, None),
    (SSB.format("4.2"), "post", {"engine": "duckdb", "params": {"years": [1997.5]}}, False, "years"),
    (SSB.format("1.1"), "post", {"engine": "duckdb", "params": {"year": 1993.0}}, True, None),
]


@pytest.mark.parametrize(("path", "method", "body", "valid", "field"), CASES,
                         ids=[f"{method} {path} {body}" for path, method, body, _, _ in CASES])
def test_the_schema_and_the_service_agree(doc, client, path, method, body, valid, field):
    """A body the schema takes is not refused with a 422 (this service has no SSB dataset: 409 is its answer);
    one the schema refuses is a 422 naming the field."""
    assert _body_validator(doc, path, method).is_valid(body) is valid
    wait_ready(client)
    if client.get("/v1/collections/c").status_code == 404:
        assert client.post("/v1/collections", json={"name": "c", "dim": 4}).status_code == 201
        assert client.put("/v1/collections/c/points", json={
            "ids": [1, 2, 3], "vectors": [[0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]]}).status_code == 200
    r = client.request(method.upper(), path.replace("{name}", "c"), json=body)
    if valid:
        assert r.status_code != 422 and r.status_code < 500, r.text
    else:
        assert r.status_code == 422 and r.json()["field"] == field, r.text


def _links(doc: dict[str, Any]) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    out = []
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            for status, response in op["responses"].items():
                for name, link in response.get("links", {}).items():
                    out.append((path, method, status, name, link))
    return out


def _operation(doc: dict[str, Any], operation_id: str) -> tuple[str, str, dict[str, Any]]:
    (found,) = [(path, method, op) for path, operations in doc["paths"].items()
                for method, op in operations.items() if op["operationId"] == operation_id]
    return found


def test_links_lead_from_what_creates_a_resource_to_the_operations_on_it(doc):
    targets: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for path, method, _, _, link in _links(doc):
        target_path, target_method, target = _operation(doc, link["operationId"])
        targets.setdefault((path, method), set()).add((target_path, target_method))
        path_params = {p["name"] for p in target.get("parameters", []) if p["in"] == "path"}
        assert {name.removeprefix("path.") for name in link.get("parameters", {})} == path_params, (path, link)
    collection = "/v1/collections/{name}"
    assert {(collection, "get"), (f"{collection}/search", "post"), (f"{collection}/points", "put"),
            (collection, "delete"), (f"{collection}/points/delete", "post")} <= targets[("/v1/collections", "post")]
    assert {(f"{collection}/points/delete", "post"), (f"{collection}/recall", "post")} <= targets[
        (f"{collection}/points", "put")]
    for creates_a_job in [(f"{collection}/build", "post"), (f"{collection}/points", "put"),
                          ("/v1/olap/ssb/generate", "post"), ("/v1/olap/ssb/import", "post")]:
        assert ("/v1/jobs/{job_id}", "get") in targets[creates_a_job]


def _evaluate(expression: Any, request_path: dict[str, str], request_body: Any, response_body: Any) -> Any:
    """The runtime expressions the links use: $request.path.X, $request.body#/X, $response.body#/X."""
    if isinstance(expression, dict):
        return {k: _evaluate(v, request_path, request_body, response_body) for k, v in expression.items()}
    if (m := re.fullmatch(r"\$request\.path\.(\w+)", expression)):
        return request_path[m[1]]
    m = re.fullmatch(r"\$(request|response)\.body#/(\w+)", expression)
    assert m, expression
    return (request_body if m[1] == "request" else response_body)[m[2]]


def test_following_the_links_works(doc, client):
    """Each link from creating a collection, upserting into it, and starting a build job, followed as a stateful
    checker would: the target answers 2xx."""
    wait_ready(client)
    calls = [("/v1/collections", "post", "201", {}, {"name": "linked", "dim": 4})]
    followed = 0
    while calls:
        path, method, status, path_params, body = calls.pop(0)
        r = client.request(method.upper(), path.format(**path_params), json=body)
        assert r.status_code == int(status), (path, r.text)
        links = doc["paths"][path][method]["responses"][status].get("links", {})
        for name, link in links.items():
            target_path, target_method, _ = _operation(doc, link["operationId"])
            params = {k.removeprefix("path."): _evaluate(v, path_params, body, r.json() if r.content else None)
                      for k, v in link.get("parameters", {}).items()}
            given = _evaluate(link["requestBody"], path_params, body, r.json()) if "requestBody" in link else {}
            followed += 1
            if name == "UpsertPoints":
                calls.append((target_path, target_method, "200", params,
                              {"ids": [1, 2], "vectors": [[0, 0, 0, 1], [0, 1, 0, 0]]}))
            elif name == "BuildCollection":
                calls.append((target_path, target_method, "202", params, None))
            elif name == "GetJob":
                assert client.get(target_path.format(**params)).status_code == 200
            elif name == "DeleteThesePoints":
                answer = client.post(target_path.format(**params), json=given)
                assert answer.status_code == 200 and answer.json()["deleted"] == 2, answer.text
            elif name == "GetCollection":
                assert client.get(target_path.format(**params)).status_code == 200
            elif name == "Recall":
                answer = client.post(target_path.format(**params), json={"sample": 2})
                assert answer.status_code == 200 and answer.json()["queries"] == 2, answer.text
    assert followed >= 10
