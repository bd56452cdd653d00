"""The hostile-client suite's SQL and bad-input attacks (issue 34, items 5, 9, 10, 11 and 13): string blowups,
SQL guard probes on PostgreSQL, date overflows against the circuit breaker, the inputs that gave a 500, and
zero vectors under cosine. Each records in its Ctx whether the service answered as the issue demands."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import orjson

from loadtests.hostile_attacks import seed_collection
from loadtests.hostile_kit import Ctx, keepalive_probe

SQL_ENGINES = ("duckdb", "postgres")


def _sql(ctx: Ctx, http: httpx.Client, sql: str, engine: str, timeout_s: float = 30) -> httpx.Response | None:
    """Ad-hoc SQL; sent again once if the service had dropped the connection (so that each query reaches it)."""
    return ctx.send(http, "POST", "/v1/olap/sql", retry=True,
                    json={"sql": sql, "engine": engine, "timeout_s": timeout_s}, timeout=timeout_s + 30)


# -- 5: SQL string blowups ------------------------------------------------------------------------------------

def _grown(depth: int) -> str:
    """A string of 10^depth bytes grown from one character by nested replace (the issue's probe)."""
    return "replace(" * depth + "'a'" + ", 'a', 'aaaaaaaaaa')" * depth


def blowup_queries(depth: int, repeat_n: int, agg_depth: int) -> dict[str, str]:
    return {f"{depth} nested replace (10^{depth} bytes)": f"SELECT length({_grown(depth)}) AS n",
            f"repeat {repeat_n:,}": f"SELECT length(repeat('x', {repeat_n})) AS n",
            f"concat of ten 10^{depth - 1}-byte strings":
                f"SELECT length(concat({', '.join([_grown(depth - 1)] * 10)})) AS n",
            f"string_agg of lineorder padded by 10^{agg_depth} bytes a row":
                f"SELECT length(string_agg(lo_orderpriority || {_grown(agg_depth)}, ',')) AS n FROM lineorder"}


def sql_blowup(ctx: Ctx) -> None:
    """Allowed string functions asked to build huge strings, on DuckDB and PostgreSQL. Demanded: refused with a
    4xx, or completed within the limits (memory: the runner's RSS check; time: within timeout_s)."""
    p = ctx.params
    with ctx.client(timeout_s=p["timeout_s"] + 60) as http:
        for engine in SQL_ENGINES:
            for label, sql in blowup_queries(p["depth"], p["repeat_n"], p["agg_depth"]).items():
                if ctx.left() < p["timeout_s"] + 5:
                    ctx.note(f"out of time before {engine}: {label}")
                    continue
                started = time.monotonic()
                r = _sql(ctx, http, sql, engine, p["timeout_s"])
                took = time.monotonic() - started
                ctx.expect_answer(f"{engine}: {label}", r, "2xx|4xx")
                ctx.expect(f"{engine}: {label} within its timeout", took < p["timeout_s"] + 5, f"{took:.1f} s")


# -- 9: SQL guard probes on PostgreSQL ------------------------------------------------------------------------

CATALOGS = {"pg_roles": "rolname, rolsuper", "pg_settings": "name, setting", "pg_class": "relname",
            "pg_stat_activity": "query", "pg_database": "datname"}


def sql_guard(ctx: Ctx) -> None:
    """A quoted CTE named like a catalog does not shadow it; attribute-call notation and current_user /
    session_user are functions too. Demanded: each refused with a 4xx (sql-rejected); a plain query still runs."""
    with ctx.client() as http:
        r = _sql(ctx, http, "SELECT count(*) AS n FROM ddate", "postgres")
        ctx.expect_answer("control: a plain query over ddate runs", r, "2xx")
        probes = {f'quoted CTE "{c.upper()}" then {c}': f'WITH "{c.upper()}" AS (SELECT 1 AS x) SELECT {cols} FROM {c}'
                  for c, cols in CATALOGS.items()}
        probes.update({"attribute call d.to_json": "SELECT d.to_json FROM ddate d",
                       "current_user": "SELECT current_user", "session_user": "SELECT session_user",
                       "current_user in a CTE": "WITH u AS (SELECT current_user AS who) SELECT who FROM u"})
        for label, sql in probes.items():
            r = _sql(ctx, http, sql, "postgres")
            ctx.expect_answer(f"postgres: {label}", r, "4xx")


# -- 10: date overflow results and the circuit breaker --------------------------------------------------------

def _breaker_open(ctx: Ctx, http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^switchyard_engine_breaker_open\{engine="([^"]+)"\} (\S+)$', text, re.M)}


def date_overflow(ctx: Ctx) -> None:
    """`SELECT DATE '9999-12-31' + 1` (and `DATE '0001-01-01' - 1`) `repeats` times in a row on each engine.
    Demanded: each a 4xx (or an answer), never a 5xx; a client error never opens a breaker, so a named query on
    duckdb still runs there and `auto` still picks it."""
    with ctx.client() as http:
        before = ctx.send(http, "POST", "/v1/olap/ssb/queries/1.1", json={"engine": "duckdb"})
        if not ctx.expect_answer("control: Q1.1 on duckdb before", before, "2xx"):
            return
        auto_before = ctx.send(http, "POST", "/v1/olap/ssb/queries/1.1", json={"engine": "auto"})
        for engine in SQL_ENGINES:
            for sql in ("SELECT DATE '9999-12-31' + 1 AS d", "SELECT DATE '0001-01-01' - 1 AS d"):
                for i in range(ctx.params["repeats"]):
                    r = _sql(ctx, http, sql, engine)
                    if i == 0 or r is None or r.status_code >= 500:
                        ctx.expect_answer(f"{engine}: {sql} (try {i + 1})", r, "2xx|4xx")
        after = ctx.send(http, "POST", "/v1/olap/ssb/queries/1.1", json={"engine": "duckdb"})
        ctx.expect_answer("Q1.1 on duckdb after the overflows", after, "2xx")
        if after is not None and after.status_code == 200:
            ctx.expect("answered by the same engine", after.json()["engine"] == before.json()["engine"],
                       f"{before.json()['engine']} -> {after.json()['engine']}")
        auto_after = ctx.send(http, "POST", "/v1/olap/ssb/queries/1.1", json={"engine": "auto"})
        if auto_before is not None and auto_after is not None and auto_before.status_code == 200:
            got = auto_after.json().get("engine") if auto_after.status_code == 200 else auto_after.status_code
            ctx.expect("auto still routes as before", got == auto_before.json()["engine"],
                       f"{auto_before.json()['engine']} -> {got}")
        opened = {e: v for e, v in _breaker_open(ctx, http).items() if v}
        ctx.expect("no breaker open", not opened, f"open: {opened}")


# -- 11: the inputs that gave a 500 ---------------------------------------------------------------------------

def bad_input(ctx: Ctx) -> None:
    """Each input the issue found answered 500, on a keep-alive connection followed by GET /healthz on it.
    Demanded: a 4xx problem+json (or, where the input is valid, an answer), and the connection kept."""
    seed_collection(ctx, "hostile_probe", 20)
    ctx.begin()
    big = "9" * 309  # past float64's range
    point = '{"ids": [1], "vectors": [[1, 0, 0, 0]], "payloads": [%s]}'
    probes: list[tuple[str, str, str, bytes, str]] = [
        ("payload int beyond 64 bits", "PUT", "/v1/collections/hostile_probe/points",
         (point % '{"n": 1180591620717411303424}').encode(), "2xx|4xx"),
        ("payload string with \\u0000", "PUT", "/v1/collections/hostile_probe/points",
         (point % '{"s": "a\\u0000b"}').encode(), "2xx|4xx"),
        ("payload key with \\u0000", "PUT", "/v1/collections/hostile_probe/points",
         (point % '{"a\\u0000b": 1}').encode(), "2xx|4xx"),
        ("309-digit filter integer", "POST", "/v1/collections/hostile_probe/search",
         ('{"vector": [1, 0, 0, 0], "k": 3, "filter": {"n": {"$gt": %s}}}' % big).encode(), "2xx|4xx"),
        ("309-digit filter equality", "POST", "/v1/collections/hostile_probe/search",
         ('{"vector": [1, 0, 0, 0], "k": 3, "filter": {"n": %s}}' % big).encode(), "2xx|4xx"),
        ("import path with NUL", "POST", "/v1/olap/ssb/import",
         orjson.dumps({"path": str(ctx.target.data_dir / "import" / "a\0b")}), "4xx"),
        ("recall seed -1", "POST", "/v1/collections/hostile_probe/recall",
         orjson.dumps({"sample": 5, "k": 3, "seed": -1}), "2xx|4xx"),
        ("SELECT $1 on postgres", "POST", "/v1/olap/sql", orjson.dumps({"sql": "SELECT $1", "engine": "postgres"}),
         "4xx"),
    ]
    headers = {"Content-Type": "application/json", **ctx.target.headers()}
    for label, method, path, body, allowed in probes:
        status, payload, ctype, survived = keepalive_probe(ctx.target.port, method, path, body, headers)
        ctx.statuses[str(status)] += 1
        ok = isinstance(status, int) and f"{status // 100}xx" in allowed.split("|")
        problem = not isinstance(status, int) or status < 400 or ctype.startswith("application/problem+json")
        detail = f"{status} {_problem_type(payload) if ctype.startswith('application/problem+json') else ctype}"
        ctx.expect(f"{label}: answered {allowed}", ok and problem, f"{detail} (wanted {allowed}, problem+json)")
        ctx.expect(f"{label}: keep-alive kept", survived, "the connection was dropped" if not survived else "")


def _problem_type(payload: bytes) -> str:
    try:
        body: dict[str, Any] = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "(no JSON)"
    return f"{str(body.get('type', '')).rsplit(':', 1)[-1]} field={body.get('field')}"


# -- 13: zero vectors under cosine ----------------------------------------------------------------------------

def zero_cosine(ctx: Ctx) -> None:
    """A zero vector in a cosine collection, searched on the resident engine and on pgvector. Demanded: one
    definition on every engine: refused with a 422 everywhere, or the same distance (never null) and order."""
    seed_collection(ctx, "hostile_zero", 0, metric="cosine")
    ctx.begin()
    with ctx.client() as http:
        r = ctx.send(http, "PUT", "/v1/collections/hostile_zero/points",
                     json={"ids": [0, 1, 2, 3], "vectors": [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]})
        ctx.expect_answer("upsert with a zero vector: stored or refused", r, "2xx|4xx")
        if r is None or r.status_code >= 400:
            r = ctx.send(http, "PUT", "/v1/collections/hostile_zero/points",
                         json={"ids": [1, 2, 3], "vectors": [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]})
        for label, query in (("a unit query", [1, 0, 0, 0]), ("the zero query", [0, 0, 0, 0])):
            answers = {}
            for engine in ("cpu", "pgvector"):
                a = ctx.send(http, "POST", "/v1/collections/hostile_zero/search",
                             json={"vector": query, "k": 4, "engine": engine, "consistency": "strong"})
                ctx.expect_answer(f"{label} on {engine}", a, "2xx|4xx")
                answers[engine] = a
            cpu, pg = answers["cpu"], answers["pgvector"]
            if cpu is None or pg is None:
                continue
            if cpu.status_code != pg.status_code:
                ctx.expect(f"{label}: one answer on both engines", False, f"cpu {cpu.status_code}, "
                           f"pgvector {pg.status_code}")
            elif cpu.status_code == 200:
                c, p = cpu.json(), pg.json()
                pairs = zip(c["distances"], p["distances"])
                same = c["ids"] == p["ids"] and all(x is not None and y is not None and abs(x - y) < 1e-4
                                                    for x, y in pairs)
                ctx.expect(f"{label}: same ids and distances on both engines", same,
                           f"cpu {c['ids']} {c['distances']}; pgvector {p['ids']} {p['distances']}")
        http.delete("/v1/collections/hostile_zero")
