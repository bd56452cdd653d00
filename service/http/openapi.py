"""The OpenAPI document as an exact contract, so generated clients (and schemathesis) can trust it:

- security is declared only where this configuration asks for a key (every /v1 route with SWITCHYARD_API_KEY,
  the probes too with SWITCHYARD_OPS_AUTH=key), so a keyless deployment does not advertise a required header;
- every status an operation can answer is listed, errors as `application/problem+json` (RFC 9457) with the
  problem schema, replacing FastAPI's `application/json` validation-error stub.

- OpenAPI links from the responses that create something (a collection, points, a layer, a job) to the operations
  on it, so a stateful checker (schemathesis's stateful phase) runs real sequences: create, write, search, delete.

The X-Request-Timeout header is described in the document's description, not declared per operation: a deadline
short enough is answered 503/504 by design, which contract checkers count as server errors.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.errors import PROBLEM_MEDIA_TYPE
from service.settings import Settings

DISK_MEMBERS = {
    "need_bytes": "what the work would write", "free_bytes": "free on the data directory's disk",
    "claimed_bytes": "what queued and running jobs will still write", "reserve_bytes": "SWITCHYARD_DISK_RESERVE_MB",
    "ssb_used_bytes": "what SSB datasets use (Parquet and the PostgreSQL copy)",
    "ssb_claimed_bytes": "what queued and running SSB jobs will still write",
    "quota_bytes": "the SSB quota (SWITCHYARD_SSB_QUOTA_GB or its default)",
}
PROBLEM = {
    "type": "object",
    "title": "Problem",
    "description": "RFC 9457 problem details. `type` is a stable URN per kind of problem (docs/api.md#errors).",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "examples": ["urn:switchyard:problem:validation-error"]},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string", "description": "The request path."},
        "field": {"type": "string", "description": "The input at fault, for bad input."},
        "errors": {"type": "array", "description": "Every field at fault, for schema validation errors.",
                   "items": {"type": "object", "properties": {
                       "field": {"type": "string"}, "in": {"type": "string"}, "reason": {"type": "string"}}}},
        "error_id": {"type": "string", "description": "Quote it when reporting a 500: the log has the cause."},
        **{name: {"type": "integer", "description": f"507 refusals of work before it starts: {text}."}
           for name, text in DISK_MEMBERS.items()},
    },
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}

ERRORS = {
    400: "A malformed header (X-Request-Timeout).",
    401: "Missing or wrong `Authorization: Bearer <key>`.",
    403: "The path named in the body is outside the directory the service may read.",
    404: "No such resource (collection, layer, dataset, job, query) named in the path or body.",
    409: "The request conflicts with the resource's state: it exists already, is in use, is empty, or no engine "
         "has the data yet.",
    413: "The body is larger than the route's limit (SWITCHYARD_MAX_BODY_BYTES, SWITCHYARD_MAX_BULK_BYTES).",
    415: "The body has a Content-Encoding (gzip...): bodies are read only as sent (Accept-Encoding: identity).",
    422: "Invalid input; `field` names it and `detail` says why.",
    429: "Over this API key's quota; retry after Retry-After.",
    500: "An unexpected failure; `error_id` locates it in the service's log.",
    503: "Overloaded (shed), the database is unavailable or busy, or the engine failed; retry after Retry-After.",
    504: "The request's deadline (X-Request-Timeout) passed before it finished.",
    507: "Not enough disk once queued and running jobs have written theirs (SWITCHYARD_DISK_RESERVE_MB), or over "
         "the SSB quota, for this write; the members *_bytes give the numbers.",
}
WRITES = {"put", "post", "delete"}

COLLECTION = "/v1/collections/{name}"
JOB = "/v1/jobs/{job_id}"
LAYER = "/v1/spatial/layers/{name}"
# (path, method, status) -> {link name: (target path, target method, link fields)}: the parameters and body of the
# target taken from the response (or request) that created the resource. A link body is merged into a generated one.
_NAME_FROM_BODY = {"parameters": {"path.name": "$response.body#/name"}}
_NAME_FROM_PATH = {"parameters": {"path.name": "$request.path.name"}}
_JOB = {"parameters": {"path.job_id": "$response.body#/job"}}
_JOB_LINKS = {"GetJob": (JOB, "get", _JOB), "CancelJob": (f"{JOB}/cancel", "post", _JOB),
              "DeleteJob": (JOB, "delete", _JOB)}
LINKS: dict[tuple[str, str, str], dict[str, tuple[str, str, dict[str, Any]]]] = {
    ("/v1/collections", "post", "201"): {
        "GetCollection": (COLLECTION, "get", _NAME_FROM_BODY),
        "UpsertPoints": (f"{COLLECTION}/points", "put", _NAME_FROM_BODY),
        "SearchCollection": (f"{COLLECTION}/search", "post", _NAME_FROM_BODY),
        "DeletePoints": (f"{COLLECTION}/points/delete", "post", _NAME_FROM_BODY),
        "BuildCollection": (f"{COLLECTION}/build", "post", _NAME_FROM_BODY),
        "DeleteCollection": (COLLECTION, "delete", _NAME_FROM_BODY),
    },
    (f"{COLLECTION}/points", "put", "200"): {
        "GetCollection": (COLLECTION, "get", _NAME_FROM_PATH),
        "SearchCollection": (f"{COLLECTION}/search", "post", _NAME_FROM_PATH),
        "Recall": (f"{COLLECTION}/recall", "post", _NAME_FROM_PATH),  # not from creating it: empty, it is a 409
        "DeleteThesePoints": (f"{COLLECTION}/points/delete", "post",
                              {**_NAME_FROM_PATH, "requestBody": {"ids": "$request.body#/ids"}}),
        "DeleteCollection": (COLLECTION, "delete", _NAME_FROM_PATH),
    },
    (f"{COLLECTION}/points", "put", "202"): _JOB_LINKS,
    (f"{COLLECTION}/points/delete", "post", "200"): {"GetCollection": (COLLECTION, "get", _NAME_FROM_PATH)},
    (f"{COLLECTION}/build", "post", "202"): _JOB_LINKS,
    (COLLECTION, "delete", "204"): {"GetCollection": (COLLECTION, "get", _NAME_FROM_PATH)},
    ("/v1/spatial/layers", "post", "201"): {"DeleteLayer": (LAYER, "delete", _NAME_FROM_BODY)},
    ("/v1/olap/ssb/generate", "post", "202"): _JOB_LINKS,
    ("/v1/olap/ssb/import", "post", "202"): _JOB_LINKS,
    (f"{JOB}/cancel", "post", "200"): {"GetJob": (JOB, "get", {"parameters": {"path.job_id": "$response.body#/id"}})},
}
READ_ONLY_POSTS = ("/search", "/recall", "/joins/", "/olap/sql", "/olap/ssb/queries/")


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the contract at /openapi.json instead of FastAPI's raw document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            raw = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = contract(raw, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the document


def contract(doc: dict[str, Any], settings: Settings) -> dict[str, Any]:
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Problem"] = PROBLEM
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if settings.server.api_key is None:
        components.pop("securitySchemes", None)
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            _shape(path, method, op, settings)
    _link(doc)
    return doc


def _link(doc: dict[str, Any]) -> None:
    """Add LINKS to the responses they start from, naming targets by their operationId (FastAPI makes them up)."""
    paths = doc.get("paths", {})
    for (path, method, status), links in LINKS.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status)
        if response is None:  # a route this configuration does not serve
            continue
        for name, (target_path, target_method, fields) in links.items():
            target = paths.get(target_path, {}).get(target_method)
            if target is not None:
                response.setdefault("links", {})[name] = {"operationId": target["operationId"], **fields}


def _shape(path: str, method: str, op: dict[str, Any], settings: Settings) -> None:
    v1 = path.startswith("/v1/")
    keyed = settings.server.api_key is not None and (v1 or settings.server.ops_auth == "key")
    if not keyed:
        op.pop("security", None)
    responses = op.setdefault("responses", {})
    for code in _error_codes(path, method, op, v1, keyed):
        entry = responses.setdefault(str(code), {})
        entry["description"] = ERRORS[code] if code == 422 else entry.get("description", ERRORS[code])
        entry["content"] = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        if code in (429, 503):
            entry["headers"] = RETRY_AFTER
    op["responses"] = dict(sorted(responses.items()))


def _error_codes(path: str, method: str, op: dict[str, Any], v1: bool, keyed: bool) -> list[int]:
    codes = {500}
    if keyed:
        codes.add(401)
    if not v1:
        return sorted(codes)
    codes |= {400, 422, 429, 503, 504}
    if path.endswith("/ssb/import"):
        codes.add(403)
    names_a_resource = "{" in path or "requestBody" in op
    if names_a_resource:
        codes |= {404, 409}
    if "requestBody" in op:
        codes |= {413, 415}
    if method in WRITES and not any(part in path for part in READ_ONLY_POSTS):
        codes.add(507)
    return sorted(codes)


def exactly_one_of(*groups: tuple[str, ...]) -> dict[str, Any]:
    """A model's `json_schema_extra` saying that exactly one group of its optional fields is given (non-null),
    as its validator enforces, so a schema-valid body is one the service accepts (`{}` is not)."""
    names = [name for group in groups for name in group]
    branches = []
    for group in groups:
        branches.append({"required": list(group), "properties": {
            name: {"not": {"type": "null"}} if name in group else {"type": "null"} for name in names}})
    return {"oneOf": branches}
