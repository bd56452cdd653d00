"""What a /v1 request is, for admission: its work class and its kind, from its method and path alone.

Work classes (service/admission/pressure.py) keep each kind of load in its own lane: light reads and searches,
writes, heavy analytics (SSB, SQL, geometry joins, recall) and job submissions (bulk loads, builds, SSB generation
and imports). The kind is the route with its names and ids left out (an SSB query keeps its id: queries differ
in cost), whose unqueued latency the class's limit follows.
"""

from __future__ import annotations

from service.admission.pressure import HEAVY, JOB, LIGHT, WRITE

NAMED = frozenset({"collections", "jobs", "datasets", "layers"})  # the segment after one of these is a name or id
HEAVY_POSTS = ("/v1/olap/ssb/queries/", "/v1/olap/sql", "/v1/spatial/joins/")
JOB_POSTS = ("/v1/olap/ssb/generate", "/v1/olap/ssb/import")


def kind_of(method: str, path: str) -> tuple[str, str]:
    """The route a request stands for, without its names: ("POST", "/v1/collections/*/search")."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        if parts[i - 1] in NAMED and i > 2:
            parts[i] = "*"
    return method, "/".join(parts)


def work_of(method: str, path: str, bulk: bool) -> tuple[str, tuple[str, str]]:
    """(work class, kind) of a /v1 request; `bulk`: a bulk load (service/http/limits.is_bulk)."""
    kind = kind_of(method, path)
    if method in ("GET", "HEAD") or (method == "POST" and path.endswith("/search")):
        return LIGHT, kind
    if method == "POST" and (path.startswith(HEAVY_POSTS) or path.endswith("/recall")):
        return HEAVY, kind
    if (method == "POST" and (path.startswith(JOB_POSTS) or path.endswith("/build"))) or bulk:
        return JOB, kind
    return WRITE, kind
