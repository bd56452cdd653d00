"""The history checker (loadtests/consistency.py): it finds each kind of anomaly in a made-up history and stays
quiet where concurrency leaves the outcome open; then a 30-second pass against a real service with several
Uvicorn workers, overlapping rebuilds and every consistency level finds nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loadtests"))

from consistency import Config, History, Op, print_report, run_check  # noqa: E402


def upsert(i: int, t0: float, t1: float | None, seq: int | None, token: int) -> Op:
    return Op(0, "upsert", [i], t0, t1, ok=t1 is not None, status=200 if t1 is not None else None, seq=seq,
              tokens=[token])


def delete(i: int, t0: float, t1: float | None, seq: int | None) -> Op:
    return Op(0, "delete", [i], t0, t1, ok=t1 is not None, status=200 if t1 is not None else None, seq=seq)


def search(i: int, t0: float, t1: float, query: int, found: int | None, distance: float = 0.0,
           level: str = "strong") -> Op:
    return Op(1, "search", [i], t0, t1, ok=True, status=200, level=level, query=query, found=found, distance=distance)


def kinds(ops: list[Op], bound_s: float = 1.0) -> list[str]:
    anomalies, _ = History(ops).check(bound_s)
    return sorted(a["kind"] for a in anomalies)


def test_a_correct_history_has_no_anomalies():
    assert kinds([upsert(1, 0, 1, 5, token=10), search(1, 2, 3, query=10, found=1),
                  upsert(1, 4, 5, 8, token=11), search(1, 6, 7, query=11, found=1),
                  delete(1, 8, 9, 9), search(2, 10, 11, query=11, found=None)]) == []


def test_each_kind_of_anomaly_is_found():
    base = [upsert(1, 0, 1, 5, token=10), upsert(2, 0, 1, 6, token=20)]
    assert kinds(base + [search(1, 2, 3, query=10, found=2, distance=3.0)]) == ["lost-write"]
    assert kinds(base + [search(1, 2, 3, query=10, found=1, distance=0.4)]) == ["stale-vector"]
    assert kinds(base + [delete(2, 2, 3, 7), search(1, 4, 5, query=10, found=2, distance=0.0)]) == [
        "deleted-returned", "lost-write"]
    assert kinds(base + [search(1, 2, 3, query=10, found=99, distance=0.5)]) == ["lost-write", "phantom"]
    failed = Op(1, "search", [1], 2, 3, ok=False, status=503, level="strong", query=10, error="unavailable")
    assert kinds(base + [failed]) == ["error"]


def test_concurrency_leaves_outcomes_open():
    # A delete in flight during the search: either answer is right.
    assert kinds([upsert(1, 0, 1, 5, token=10), delete(1, 2.5, 4, 6), search(1, 2, 3, query=10, found=1)]) == []
    assert kinds([upsert(1, 0, 1, 5, token=10), delete(1, 2.5, 4, 6), search(1, 2, 3, query=10, found=None)]) == []
    # A write with no answer (itself an error) may have happened at any time after it was sent.
    assert kinds([upsert(1, 0, 1, 5, token=10), delete(1, 2, None, None), search(1, 9, 10, query=10, found=None)]) == [
        "error"]
    # Two acknowledged writes that overlapped are ordered by their seq, not by when they returned.
    ops = [upsert(1, 0, 3, 9, token=11), upsert(1, 1, 2, 7, token=10)]
    assert kinds(ops + [search(1, 4, 5, query=11, found=1)]) == []
    assert kinds(ops + [search(1, 4, 5, query=10, found=1, distance=2.0)]) == []  # token 10 is not the latest
    assert kinds([upsert(1, 0, 3, 9, token=11), delete(1, 1, 2, 7), search(1, 4, 5, query=11, found=None)]) == [
        "lost-write"]
    # Overlapping upserts that one group commit carried share a seq: the server's order of arrival decided.
    grouped = [upsert(1, 0, 3, 9, token=11), upsert(1, 1, 2, 9, token=10)]
    assert kinds(grouped + [search(1, 4, 5, query=10, found=1)]) == []
    # holding token 10: no stale vector
    assert kinds(grouped + [search(1, 4, 5, query=11, found=1, distance=2.0)]) == []


def test_a_request_shed_before_it_ran_is_a_definite_failure_not_an_anomaly():
    shed = '{"type":"urn:switchyard:problem:overloaded","title":"Overloaded","status":503}'
    refused_search = Op(1, "search", [1], 2, 3, ok=False, status=503, level="strong", query=10, error=shed)
    refused_write = Op(0, "upsert", [1], 4, 5, ok=False, status=503, seq=None, tokens=[11], error=shed)
    assert refused_write.failed and refused_search.refused
    # The refused upsert of token 11 did not happen: the search must still find token 10.
    assert kinds([upsert(1, 0, 1, 5, token=10), refused_search, refused_write,
                  search(1, 6, 7, query=10, found=1)]) == []
    broken = Op(0, "upsert", [1], 4, 5, ok=False, status=503, tokens=[11], error='{"type":"urn:switchyard:problem:x"}')
    assert not broken.refused and kinds([broken]) == ["error"]  # any other 5xx is still an error


def test_levels_are_judged_by_their_own_promise():
    ops = [upsert(1, 0, 1, 5, token=10)]
    # bounded (1 s): a write that completed under a second before the search need not be seen ...
    assert kinds(ops + [search(1, 1.5, 1.6, query=10, found=None, level="bounded")]) == []
    # ... one that completed longer ago must.
    assert kinds(ops + [search(1, 2.5, 2.6, query=10, found=None, level="bounded")]) == ["lost-write"]
    assert kinds(ops + [search(1, 1.5, 1.6, query=10, found=None, level="session")]) == ["lost-write"]
    assert kinds(ops + [search(1, 9, 10, query=10, found=None, level="eventually")]) == []


@pytest.mark.timeout(240)
def test_a_30_second_pass_against_several_workers_finds_nothing(tmp_path):
    from benchkit import Service

    (tmp_path / "data").mkdir()
    workers = 3
    service = Service(tmp_path / "data", env={
        "SWITCHYARD_WORKERS": str(workers), "SWITCHYARD_REBUILD_DEAD_FRACTION": "0.02",
        "SWITCHYARD_REBUILD_DELTA_ROWS": "50"})
    service.start()
    try:
        report = run_check(Config(url=service.url, clients=6, duration_s=30, settle_s=3), workers, bound_s=1.0)
    finally:
        service.stop()
    print_report(report)
    assert report["operations"] > 1000
    assert report["refused"] < 0.1 * report["operations"]  # shed by admission control: not run, not an anomaly
    assert set(report["judged"]) >= {"strong", "session", "bounded"}
    assert report["digests"]["checked"] and len(report["digests"]["replicas"]) == workers
    assert sum(r["rebuilds"] for r in report["digests"]["replicas"]) > 0
    assert report["anomalies"] == 0, report["by_anomaly"]
