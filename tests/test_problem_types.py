"""One meaning per problem type: every (type, status) the code can answer is the one docs/api.md's error table
gives that type, and a type the table gives one status is never answered with another."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import service
from service import errors

ROOT = Path(__file__).resolve().parent.parent


def _table() -> dict[str, set[int]]:
    """docs/api.md's error table: type -> the statuses it lists (`503 / 504` lists two)."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Errors"):]
    rows = re.findall(r"^\| `([a-z-]+)` \| ([0-9 /]+) \|", section, re.MULTILINE)
    assert rows, "no error table in docs/api.md"
    return {slug: {int(s) for s in statuses.split("/")} for slug, statuses in rows}


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _answered() -> dict[str, dict[int, list[str]]]:
    """Every (type, status) the code answers with, and where: the ProblemError classes, the domain errors'
    mapping, Starlette's statuses, and each literal problem_response(status, "type", ...) in service/."""
    found: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module in pkgutil.walk_packages(service.__path__, "service."):
        importlib.import_module(module.name)  # every ProblemError subclass is defined somewhere under service/
    for cls in [errors.ProblemError, *_subclasses(errors.ProblemError)]:
        found[cls.slug][cls.status].append(f"{cls.__module__}.{cls.__name__}")

    from indexes.errors import VectorError
    from olap.manager import DatasetInUse, EngineNotReady
    from olap.results import QueryFailed
    from olap.sqlguard import SqlRejected
    from spatial.manager import SpatialEngineNotReady
    from spatial.store import LayerExists, LayerNotFound

    domain = [*_subclasses(VectorError), DatasetInUse, EngineNotReady, QueryFailed, SqlRejected,
              SpatialEngineNotReady, LayerExists, LayerNotFound, TimeoutError, ValueError, RuntimeError]
    for cls in domain:
        status, slug, _, _ = errors._domain_problem(cls("x"))
        found[slug][status].append(f"_domain_problem({cls.__name__})")
    for status, (slug, _) in errors._HTTP_SLUGS.items():
        found[slug][status].append("_HTTP_SLUGS")
    literal = re.compile(r'problem_response\(\s*(\d{3}),\s*"([a-z-]+)"')
    for path in (ROOT / "service").rglob("*.py"):
        for status, slug in literal.findall(path.read_text()):
            found[slug][int(status)].append(str(path.relative_to(ROOT)))
    return found


def test_each_problem_type_has_the_one_status_the_error_table_gives_it():
    table, answered = _table(), _answered()
    assert "engine-unavailable" in answered and "unavailable" in answered  # the walk found what it should
    wrong = []
    for slug, statuses in sorted(answered.items()):
        if slug not in table:
            wrong.append(f"{slug}: answered by {dict(statuses)} but not in docs/api.md's error table")
        elif set(statuses) != table[slug]:
            wrong.append(f"{slug}: the table says {sorted(table[slug])}, the code answers {dict(statuses)}")
    assert not wrong, "\n".join(wrong)
    unused = set(table) - set(answered)
    assert not unused, f"types in the table that nothing answers: {sorted(unused)}"



def test_a_front_whose_engine_process_is_gone_answers_503_unavailable(tmp_path):
    """Behind the fronts, an engine process that cannot be reached is a 503 to retry, not the 409 that says the
    engine a request names cannot serve it."""
    import asyncio

    import httpx

    from service.process.front import Front
    from service.process.links import EngineSockets, ProcessLinks
    from service.settings import Settings

    links = ProcessLinks((EngineSockets(tmp_path / "gone.sock", tmp_path / "gone-http.sock"),))
    front = Front(Settings(), links)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return [await client.post("/v1/collections/c/search", json={"vector": [0.0, 1.0], "k": 1}),  # parsed
                    await client.get("/v1/collections")]  # passed through over HTTP

    for response in asyncio.run(run()):
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == errors.PROBLEM_MEDIA_TYPE
        assert response.json()["type"] == errors.TYPE_PREFIX + "unavailable"
        assert int(response.headers["retry-after"]) >= 1
