"""Payload filters: one conformance suite runs the same filters on every engine against a numpy oracle built from
the attributes the payloads were made of (not from the filter code); bad filters are 422s naming the path; the
resident path asks PostgreSQL nothing; recall targets hold on held-out queries.
"""

from __future__ import annotations

import traceback
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from helpers import service_client, wait_job
from indexes import filters
from indexes.errors import InvalidInput
from test_vectors_conformance import engine_param
from vector_data import b64, clustered, oracle, recall

DIM, N, NQ, K = 16, 3000, 30, 10
DATA = clustered(N, DIM, seed=11)
QUERIES = clustered(NQ, DIM, seed=12)
COLORS = np.array(["red", "green", "blue"])
EPOCH0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _attributes() -> dict[str, np.ndarray]:
    """What each point's payload says, as arrays: the oracle reads these, the service reads the payloads."""
    i = np.arange(N)
    rng = np.random.default_rng(5)
    return {
        "has_payload": i % 13 != 0,
        "n": (i % 100).astype(float) + np.where(i % 17 == 0, 0.5, 0.0),  # numbers, a few non-integers
        "n_is_text": i % 23 == 0,  # "n" holds the string "7" there: not a number
        "color": i % 7,  # 0: no color key; 1..6 -> COLORS[(c - 1) % 3]
        "seconds": rng.integers(0, 366 * 86400, N),  # "day": an instant in 2024 ...
        "day_style": i % 4,  # ... written as a date (0), a UTC time (1), a time with an offset (2), not a date (3)
        "flag": i % 5,  # 0: null, 1-2: true, 3-4: false
        "tags": i % 11 == 0,  # an array value
    }


ATTR = _attributes()


def _payload(j: int) -> dict | None:
    if not ATTR["has_payload"][j]:
        return None
    p: dict = {"n": "7" if ATTR["n_is_text"][j] else (int(ATTR["n"][j]) if ATTR["n"][j] % 1 == 0 else ATTR["n"][j])}
    if ATTR["color"][j]:
        p["color"] = str(COLORS[(ATTR["color"][j] - 1) % 3])
    moment = EPOCH0 + timedelta(seconds=int(ATTR["seconds"][j]))
    style = ATTR["day_style"][j]
    if style == 0:
        p["day"] = moment.strftime("%Y-%m-%d")
    elif style == 1:
        p["day"] = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    elif style == 2:  # the same instant, written at +02:00
        p["day"] = (moment + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%S+02:00")
    else:
        p["day"] = "2023-02-30"  # looks like a date, is none
    p["flag"] = None if ATTR["flag"][j] == 0 else bool(ATTR["flag"][j] <= 2)
    if ATTR["tags"][j]:
        p["tags"] = ["a", "b"]
    return p


PAYLOADS = [_payload(j) for j in range(N)]


def _day_seconds() -> np.ndarray:
    """Seconds since 2024-01-01 of each point's day as a filter sees it (a date means its midnight); NaN: none."""
    s = ATTR["seconds"].astype(float)
    out = np.where(ATTR["day_style"] == 0, s - s % 86400, s)
    return np.where((ATTR["day_style"] == 3) | ~ATTR["has_payload"], np.nan, out)


def _since(text: str) -> float:
    return (datetime.fromisoformat(text.replace("Z", "+00:00")).replace(tzinfo=timezone.utc) - EPOCH0).total_seconds()


HAS = ATTR["has_payload"]
NUM = HAS & ~ATTR["n_is_text"]
N_TEXT7 = HAS & ATTR["n_is_text"]
COLOR = np.where(HAS & (ATTR["color"] > 0), COLORS[(ATTR["color"] - 1) % 3], "")
DAY = _day_seconds()
FLAG_TRUE = HAS & (ATTR["flag"] >= 1) & (ATTR["flag"] <= 2)
FLAG_NULL = HAS & (ATTR["flag"] == 0)
with np.errstate(invalid="ignore"):
    CASES = [
        ({"n": 5}, NUM & (ATTR["n"] == 5)),
        ({"n": {"$gte": 10, "$lt": 30}}, NUM & (ATTR["n"] >= 10) & (ATTR["n"] < 30)),
        ({"n": {"$in": [1, 2, 3.5, "7"]}}, (NUM & np.isin(ATTR["n"], [1, 2, 3.5])) | N_TEXT7),
        ({"n": {"$ne": 5}}, ~(NUM & (ATTR["n"] == 5))),
        ({"color": {"$nin": ["red"]}}, COLOR != "red"),
        ({"day": {"$gte": "2024-03-01", "$lt": "2024-06-01T00:00:00Z"}},
         (DAY >= _since("2024-03-01")) & (DAY < _since("2024-06-01T00:00:00Z"))),
        ({"day": {"$gt": "2024-07-01T12:00:00+02:00"}}, DAY > _since("2024-07-01T10:00:00")),
        ({"$or": [{"color": "blue"}, {"flag": True}]}, (COLOR == "blue") | FLAG_TRUE),
        ({"$not": {"color": {"$exists": True}}}, COLOR == ""),
        ({"flag": None}, FLAG_NULL),
        ({"flag": 1}, np.zeros(N, dtype=bool)),  # booleans are not numbers (and True == 1 must not share a cache entry)
        ({"flag": True}, FLAG_TRUE),
        ({"flag": {"$in": [1, True]}}, FLAG_TRUE),  # true is kept beside 1 (equal in Python, not here)
        ({"tags": {"$exists": True}}, HAS & ATTR["tags"]),
        ({"tags": "a"}, np.zeros(N, dtype=bool)),  # arrays match only $exists
        ({"$and": [{"n": {"$lt": 50}}, {"$not": {"color": "green"}}]}, NUM & (ATTR["n"] < 50) & (COLOR != "green")),
        ({"n": 42, "color": "red"}, NUM & (ATTR["n"] == 42) & (COLOR == "red")),  # very selective
        ({"n": {"$lt": 95}}, NUM & (ATTR["n"] < 95)),  # keeps most rows: the ANN plan
    ]

ENGINES = [
    # (id, engine, index type, build params, search params, exact?)
    ("cpu-brute_force", "cpu", "brute_force", {}, {}, True),
    ("cpu-hnsw", "cpu", "hnsw", {"m": 16, "ef_construction": 64}, {"ef": 64}, False),
    ("cpu-ivf_flat", "cpu", "ivf_flat", {"n_lists": 16}, {"n_probes": 4}, False),
    ("pgvector-exact", "pgvector", "brute_force", {}, {}, True),
    ("pgvector-hnsw", "pgvector", "brute_force", {}, {"ef_search": 100}, False),
    ("gpu-cagra", "gpu", "cagra", {}, {"itopk_size": 64}, False),
]


@pytest.fixture(scope="module")
def app(server_dsn, tmp_path_factory):
    with service_client(server_dsn, "vectors_filters", tmp_path_factory.mktemp("filters")) as client:
        yield client


def make_collection(client, name: str, index_type: str, build: dict, data: np.ndarray, payloads: list,
                    pg_index: dict | None = None) -> None:
    r = client.post("/v1/collections", json={"name": name, "dim": data.shape[1], "metric": "l2",
                                             "index": {"type": index_type, "params": build},
                                             "pgvector_index": pg_index or {"type": "none"}})
    assert r.status_code == 201, r.text
    for start in range(0, len(data), 5000):
        part = slice(start, start + 5000)
        r = client.put(f"/v1/collections/{name}/points", json={
            "ids": list(range(len(data)))[part], "vectors_b64": b64(data[part]), "payloads": payloads[part]})
        assert r.status_code == 200, r.text
    state = wait_job(client, client.post(f"/v1/collections/{name}/build").json()["location"])
    assert state["state"] == "succeeded", state


def forget_plans(client) -> None:
    """Drop the filter rows and plans each resident collection remembers: made under the planner's constants of
    the moment, which some tests patch."""
    for replica in client.app.state.switchyard.vectors.resident.values():
        replica.index.filters.clear()


@pytest.fixture(autouse=True)
def _fresh_plans(app):
    yield
    forget_plans(app)


def collection_for(client, engine_id: str) -> str:
    if engine_id in client.made:
        return client.made[engine_id]
    _, _, index_type, build, _, _ = next(e for e in ENGINES if e[0] == engine_id)
    name = f"f-{engine_id}".replace("_", "-")
    pg_index = {"type": "hnsw", "m": 16, "ef_construction": 64} if engine_id == "pgvector-hnsw" else None
    make_collection(client, name, index_type, build, DATA, PAYLOADS, pg_index)
    client.made[engine_id] = name
    return name


def _engine_modes() -> list:
    """`planned`: the planner's choice (exact for most filters on 3,000 rows); `index-forced` (resident ANN
    engines): the index with the filter bitmap and raised effort whatever the selectivity."""
    out = []
    for engine_id, engine, _, _, _, exact in ENGINES:
        for mode in ("planned",) if exact or engine == "pgvector" else ("planned", "index-forced"):
            param = engine_param(engine_id)
            out.append(pytest.param(engine_id, mode, marks=param.marks, id=f"{engine_id}-{mode}"))
    return out


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("engine_id,plan_mode", _engine_modes())
def test_every_engine_gives_the_oracles_rows(app, engine_id, plan_mode, case, monkeypatch):
    """The same filter on every engine: only matching rows, as many as there are up to k, and the exact top-k of
    the matching rows (exact engines) or recall >= 0.9 of it (ANN engines)."""
    _, engine, _, _, params, exact = next(e for e in ENGINES if e[0] == engine_id)
    if plan_mode == "index-forced":
        from indexes import planner

        monkeypatch.setattr(planner, "EXACT_MIN_ROWS", 0)
        monkeypatch.setattr(planner, "ann_rows", lambda *args: 0)
    where, mask = CASES[case]
    name = collection_for(app, engine_id)
    r = app.post(f"/v1/collections/{name}/search", json={"vectors_b64": b64(QUERIES), "k": K, "engine": engine,
                                                          "params": params or None, "filter": where})
    assert r.status_code == 200, r.text
    got = r.json()
    matching = np.flatnonzero(mask)
    for ids in got["ids"]:
        assert set(ids) <= set(matching.tolist()), (where, sorted(set(ids) - set(matching.tolist()))[:5])
        if exact or plan_mode == "planned":  # the planner answers few matching rows exactly: all of them
            assert len(ids) == min(K, len(matching))
    if len(matching) == 0 or plan_mode == "index-forced" and len(matching) < 0.02 * N:
        return  # a graph search under so tight a filter misses rows: why the planner answers these exactly
    truth_rows, _ = oracle(DATA[matching], QUERIES, min(K, len(matching)), "l2")
    assert recall(got["ids"], matching[truth_rows]) >= (1.0 if exact else 0.9)
    if engine == "cpu":
        plan = got["plan"]
        assert plan["matched_rows"] == len(matching) and abs(plan["selectivity"] - len(matching) / N) < 1e-6
        if exact or plan_mode == "index-forced":
            assert plan["plan"] == ("exact" if exact else "ann-filtered")


def test_the_planner_picks_exact_for_selective_filters_and_the_index_otherwise(app, monkeypatch):
    from indexes import planner

    name = collection_for(app, "cpu-hnsw")

    def plan(where: dict) -> dict:
        r = app.post(f"/v1/collections/{name}/search", json={"vector": QUERIES[0].tolist(), "k": K,
                                                              "params": {"ef": 64}, "filter": where})
        assert r.status_code == 200, r.text
        return r.json()["plan"]

    assert plan({"n": 42, "color": "red"})["plan"] == "exact"
    assert plan({"n": {"$lt": 95}})["plan"] == "exact"  # 2,500 rows: fewer than HNSW at this effort would touch
    monkeypatch.setattr(planner, "HNSW_ROWS_PER_EF", 1)  # as if the collection were six times larger
    forget_plans(app)  # plans are remembered with a filter's rows, and this one's was made above
    broad = plan({"n": {"$lt": 95}})
    assert broad["plan"] == "ann-filtered" and broad["params"]["ef"] > 64  # effort raised as selectivity falls
    # The payload fields are reported, with how many live rows hold each kind of value.
    fields = app.get(f"/v1/collections/{name}").json()["index_state"]["payload_fields"]
    assert fields["n"] == {"number": int(NUM.sum()), "string": int(N_TEXT7.sum())}
    assert fields["tags"] == {"other": int((HAS & ATTR["tags"]).sum())}


BAD = [
    ({"price": {"$between": [1, 2]}}, "filter.price.$between"),
    ({"$or": [{"a": 1}, {"b": {"$gte": "soon"}}]}, "filter.$or[1].b.$gte"),
    ({"$or": []}, "filter.$or"),
    ({"a": {"$in": "x"}}, "filter.a.$in"),
    ({"a": {"$exists": 1}}, "filter.a.$exists"),
    ({"a": {"$eq": [1, 2]}}, "filter.a.$eq"),
    ({"$nor": [{"a": 1}]}, "filter.$nor"),
    ({"$not": {"$not": {"$not": {"$not": {"$not": {"$not": {"$not": {"$not": {"$not": {"a": 1}}}}}}}}}},
     "filter.$not.$not.$not.$not.$not.$not.$not.$not.$not"),
    ({"a": {"$gt": True}}, "filter.a.$gt"),
    ({"a": {"$lt": "2023-02-30"}}, "filter.a.$lt"),
]


@pytest.mark.parametrize("where,path", BAD, ids=[b[1] for b in BAD])
@pytest.mark.parametrize("engine", ["cpu", "pgvector"])
def test_bad_filters_are_422s_naming_the_path(app, where, path, engine):
    name = collection_for(app, "cpu-brute_force")
    r = app.post(f"/v1/collections/{name}/search", json={"vector": QUERIES[0].tolist(), "engine": engine,
                                                          "filter": where})
    assert r.status_code == 422, r.text
    body = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert any(e.get("field") == path for e in body.get("errors", [body])) or body.get("field") == path, body


def test_filter_parser_limits():
    with pytest.raises(InvalidInput) as too_many:
        filters.parse({"$and": [{f"f{i}": i} for i in range(filters.MAX_CONDITIONS + 1)]})
    assert too_many.value.field.startswith("filter.$and[")
    assert filters.parse({}) is None and filters.parse(None) is None
    assert filters.instant("2024-02-29") == _since("2024-02-29") + EPOCH0.timestamp()
    assert filters.instant("2023-02-29") is None and filters.instant("2024-1-1") is None


def test_a_repeated_filter_is_parsed_once_and_lookalikes_stay_apart():
    first = filters.parse({"n": {"$lt": 95}, "flag": True})
    assert filters.parse({"n": {"$lt": 95}, "flag": True}) is first  # remembered by its JSON text
    assert filters.key(first) == repr(first)
    # Equal in Python (True == 1 == 1.0), different filters: neither the tree nor the key may be shared.
    as_bool, as_int = filters.parse({"flag": True}), filters.parse({"flag": 1})
    assert as_bool.value is True and as_int.value == 1.0 and not isinstance(as_int.value, bool)
    assert filters.key(as_bool) != filters.key(as_int)
    for _ in range(2):  # a refused filter is refused every time, not remembered
        with pytest.raises(InvalidInput):
            filters.parse({"flag": {"$gt": True}})


def test_large_filters_are_remembered_within_a_byte_budget_and_never_kept_as_keys(monkeypatch):
    """Distinct large filters (a long $in) must not grow the parse caches past their budget, and what other caches
    (the filter rows, the micro-batcher's learnt costs) key them by stays small: a digest, which still tells
    filters apart. The most recent ones are remembered: one request parses its filter more than once."""
    monkeypatch.setattr(filters, "RECENT_LARGE_BYTES", 20_000)
    monkeypatch.setattr(filters, "_recent_large", type(filters._recent_large)())
    before = len(filters._parsed)

    def large(i):
        return {"tag": {"$in": [f"{i}-{j:04d}".ljust(48, "x") for j in range(100)]}}  # about 5.5 KB of JSON

    trees = [filters.parse(large(i)) for i in range(8)]
    assert len(filters._parsed) == before
    assert 0 < sum(map(len, filters._recent_large)) <= 20_000 and len(filters._recent_large) < 8
    keys = {filters.key(tree) for tree in trees}
    assert len(keys) == 8 and all(len(key) <= filters.KEY_CHARS for key in keys)
    assert filters.parse(large(7)) is trees[7]  # the most recent: a look-up
    again = filters.parse(large(0))  # forgotten: parsed again, to an equal tree with the same key
    assert again is not trees[0] and again == trees[0] and filters.key(again) == filters.key(trees[0])
    # A large filter too long to remember is parsed every time, and its key is still a digest.
    monkeypatch.setattr(filters, "RECENT_LARGE_BYTES", 1_000)
    assert filters.parse(large(9)) is not filters.parse(large(9))
    assert len(filters.key(filters.parse(large(9)))) <= filters.KEY_CHARS


def test_a_long_in_list_refuses_the_value_it_cannot_hold_by_its_index():
    values = [f"v{j}" for j in range(500)]
    for bad, message in (("a\x00b", "NUL"), ({"x": 1}, "must be a string")):
        with pytest.raises(InvalidInput, match=message) as refused:
            filters.parse({"tag": {"$nin": [*values[:300], bad, *values[300:]]}})
        assert refused.value.field == "filter.tag.$nin[300]"
    mixed = filters.parse({"tag": {"$in": ["a", 1, True, None, "a", 1.0]}})
    assert mixed.value == ("a", 1.0, True, None)  # distinct, numbers as floats, true apart from 1


def test_a_filtered_search_on_the_resident_path_asks_postgresql_nothing(app, monkeypatch):
    name = collection_for(app, "cpu-hnsw")
    vectors = app.app.state.switchyard.vectors
    calls = []

    def spy(method):
        real = getattr(vectors.pool, method)

        def spied(*args, **kwargs):  # background work (the follower's poll) may use the pool: only searches count
            if "answer_search" in [frame.name for frame in traceback.extract_stack()]:
                calls.append(method)
            return real(*args, **kwargs)
        return spied

    for method in ("acquire", "fetch", "fetchrow", "fetchval", "execute", "executemany"):
        monkeypatch.setattr(vectors.pool, method, spy(method))
    r = app.post(f"/v1/collections/{name}/search", json={"vector": QUERIES[0].tolist(), "engine": "pgvector",
                                                          "filter": CASES[0][0]})
    assert r.status_code == 200 and calls, "the spy sees a pgvector search's queries"
    calls.clear()
    for where, _ in CASES[:4]:
        r = app.post(f"/v1/collections/{name}/search", json={
            "vectors_b64": b64(QUERIES[:3]), "k": K, "engine": "cpu", "params": {"ef": 64}, "filter": where,
            "consistency": "eventually"})
        assert r.status_code == 200, r.text
    monkeypatch.undo()
    assert calls == []


def test_payloads_follow_replacements_deletes_and_rebuilds(app):
    """An upsert replaces the payload with the vector; a delete removes both; a rebuild keeps them in step."""
    name = "f-writes"
    make_collection(app, name, "hnsw", {"m": 16, "ef_construction": 40}, DATA[:500],
                    [{"g": i % 5} for i in range(500)])
    r = app.put(f"/v1/collections/{name}/points", json={"ids": [0, 1, 2], "vectors_b64": b64(DATA[:3]),
                                                        "payloads": [{"g": 9}, {"g": 9}, None]})
    assert r.status_code == 200
    assert app.post(f"/v1/collections/{name}/points/delete", json={"ids": [1, 5]}).status_code == 200

    def matching(where: dict) -> set[int]:
        r = app.post(f"/v1/collections/{name}/search", json={"vector": DATA[0].tolist(), "k": 500, "engine": "cpu",
                                                              "filter": where, "consistency": "strong"})
        assert r.status_code == 200, r.text
        return set(r.json()["ids"])

    before = (matching({"g": 9}), matching({"g": 0}), matching({"g": {"$exists": False}}))
    assert before == ({0}, {i for i in range(10, 500, 5)}, {2})
    assert wait_job(app, app.post(f"/v1/collections/{name}/build").json()["location"])["state"] == "succeeded"
    assert (matching({"g": 9}), matching({"g": 0}), matching({"g": {"$exists": False}})) == before


@pytest.fixture(scope="module")
def targeted(app):
    """20,000 x 24 clustered vectors in an HNSW index, and 200 held-out queries (never stored)."""
    both = clustered(20_200, 24, seed=21, clusters=50)  # one distribution: queries like the stored vectors
    data, held_out = both[:20_000], both[20_000:]
    make_collection(app, "f-target", "hnsw", {"m": 12, "ef_construction": 40}, data, [None] * len(data))
    truth, _ = oracle(data, held_out, K, "l2")
    return data, held_out, truth


@pytest.mark.parametrize("target", [0.9, 0.95, 0.99])
def test_a_recall_target_holds_on_held_out_queries(app, targeted, target):
    _, held_out, truth = targeted
    r = app.post("/v1/collections/f-target/search", json={"vectors_b64": b64(held_out), "k": K, "engine": "cpu",
                                                          "recall_target": target})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["plan"]["recall_target"] == target and body["plan"]["calibrated_recall"] >= target
    assert recall(body["ids"], truth) >= target - 0.01, body["plan"]
    # POST .../recall verifies it the same way on the queries given.
    check = app.post("/v1/collections/f-target/recall", json={"k": K, "engine": "cpu", "recall_target": target,
                                                               "queries": held_out.tolist()}).json()
    assert check["recall"] >= target - 0.01 and check["plan"]["params"] == body["plan"]["params"]


def test_the_calibration_is_reported_and_bad_targets_are_refused(app, targeted):
    calibration = app.get("/v1/collections/f-target").json()["index_state"]["calibration"]
    assert calibration["index_type"] == "hnsw" and calibration["k"] == K
    assert calibration["rows"] + calibration["queries"] == 20_000  # the held-out queries were not in the index
    recalls = [p["recall"] for p in calibration["points"]]
    assert recalls[-1] > recalls[0] and all(0 <= x <= 1 for x in recalls)
    for body, field in (({"recall_target": 1.5}, "recall_target"),
                        ({"recall_target": 0.9, "params": {"ef": 10}}, "recall_target")):
        r = app.post("/v1/collections/f-target/search", json={"vector": [0.0] * 24, "engine": "cpu", **body})
        assert r.status_code == 422 and r.json()["field"] == field, r.text
