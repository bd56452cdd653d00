"""The Locust harness (`switchyard loadtest`): short headless runs against a service started here, checked
against figures computed independently from the same responses. Locust runs in child processes only: importing
it here would monkey-patch the test process with gevent."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from conftest import fresh_database
from loadtests import datasets, runner
from loadtests.processes import local_service
from loadtests.ssb_params import GENERATORS, random_params, random_sql
from loadtests.sweep import latency_bucket, percentiles
from loadtests.workloads import LEVELS, read_your_writes

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def service(server_dsn: str, tmp_path: Path):
    """`switchyard serve` in a child process on a fresh database; yields a function giving its URL."""
    with fresh_database(server_dsn, "loadtest") as dsn:
        def start(workers: int = 1):
            return local_service(workers, str(tmp_path / "data"), tmp_path / "service.log",
                                 env={"SWITCHYARD_DATABASE_URL": dsn})
        yield start


def _exact_neighbors(base: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """numpy brute force: the oracle, independent of the harness's FAISS ground truth."""
    d = (queries ** 2).sum(1)[:, None] - 2 * queries @ base.T + (base ** 2).sum(1)[None, :]
    return np.argsort(d, axis=1, kind="stable")[:, :k]


def test_vectors_report_and_recall_equal_offline_recall(service, server_dsn: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((3000, 16)).astype(np.float32)
    queries = rng.standard_normal((80, 16)).astype(np.float32)
    np.save(tmp_path / "base.npy", base)
    np.save(tmp_path / "queries.npy", queries)
    out = tmp_path / "report"
    with fresh_database(server_dsn, "baseline") as baseline_dsn, service() as url:
        rc = runner.main(["vectors", "--url", url, "--vectors", str(tmp_path / "base.npy"), "--queries",
                          str(tmp_path / "queries.npy"), "--users", "1,2", "--param-users", "2", "--duration", "2",
                          "--sweep", "cpu=4,64", "--sweep", "pgvector=40", "--sweep", "pgvector-direct=40",
                          "--baseline", "pgvector-direct", baseline_dsn, "--record-responses", "--out", str(out)])
    assert rc == 0
    for name in ("summary.json", "summary.md", "recall_vs_qps.png", "latency_vs_users.png", "qps_vs_users.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    points = summary["points"]
    assert {p["target"] for p in points} == {"cpu", "pgvector", "pgvector-direct"}
    assert {(p["target"], p["users"]) for p in points} >= {(t, u) for t in ("cpu", "pgvector", "pgvector-direct")
                                                              for u in (1, 2)}
    truth = _exact_neighbors(base, queries, 10)
    for p in points:
        folder = out / p["folder"]
        assert (folder / "locust_stats.csv").exists() and (folder / "report.html").stat().st_size > 0
        assert p["failures"] == 0 and p["qps"] > 0
        answers = [json.loads(line) for line in (folder / "responses.jsonl").read_text().splitlines()]
        offline = np.mean([len(set(a["ids"]) & set(truth[a["query"]].tolist())) / 10 for a in answers])
        assert len(answers) == p["requests"]  # one query per request: every answer was scored
        assert p["recall"] == pytest.approx(offline, abs=1e-6), p["label"]
        assert p["recall_exact"] == pytest.approx(offline, abs=1e-6), p["label"]
    by_setting = {(p["target"], p["setting"]): p["recall"] for p in points if p["stage"] == "params"}
    assert by_setting[("cpu", "ef=4")] < by_setting[("cpu", "ef=64")]  # the sweep really changed the search
    assert "| pgvector-direct |" in (out / "summary.md").read_text()


def test_mixed_read_your_writes_comes_from_real_responses(service, tmp_path: Path) -> None:
    out = tmp_path / "report"
    with service(workers=2) as url:
        rc = runner.main(["vectors-mixed", "--url", url, "--rows", "2000", "--dim", "16", "--index", "brute_force",
                          "--users", "2", "--duration", "4", "--write-rate", "25", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    point = summary["points"][0]
    stats = {f"{r['Type']} {r['Name']}": r for r in csv.DictReader(open(out / point["folder"] / "locust_stats.csv"))}
    ryw = point["read_your_writes"]
    for level in LEVELS:
        probes = ryw[level]["upsert_probes"] + ryw[level]["delete_probes"]
        assert probes == int(stats[f"POST probe {level}"]["Request Count"]) > 0  # one figure per real probe
    for level in ("strong", "session"):  # what these levels promise, across 2 worker processes
        assert ryw[level]["upsert_found"] == ryw[level]["upsert_probes"]
        assert ryw[level]["delete_gone"] == ryw[level]["delete_probes"]
        assert ryw[level]["deleted_returned_broken"] == 0
    assert (out / "read_your_writes.png").stat().st_size > 0


class _StaleService(BaseHTTPRequestHandler):
    """A service that acknowledges deletes but goes on returning the deleted ids: the harness must catch it."""

    points: dict[int, np.ndarray] = {}
    seq = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def do_PUT(self) -> None:
        import base64

        body = self._body()
        vectors = np.frombuffer(base64.b64decode(body["vectors_b64"]), "<f4").reshape(len(body["ids"]), -1)
        with self.lock:
            type(self).points.update(zip(body["ids"], vectors))
            type(self).seq += 1
            self._answer({"upserted": len(body["ids"]), "seq": self.seq})

    def do_POST(self) -> None:
        import base64

        body = self._body()
        if self.path.endswith("/points/delete"):
            with self.lock:
                type(self).seq += 1
                return self._answer({"deleted": len(body["ids"]), "seq": self.seq})  # ... and forgets nothing
        query = np.frombuffer(base64.b64decode(body["vectors_b64"]), "<f4")
        with self.lock:
            ids = list(self.points)
            matrix = np.stack([self.points[i] for i in ids]) if ids else np.zeros((0, len(query)), np.float32)
        order = np.argsort(((matrix - query) ** 2).sum(1))[: body["k"]]
        self._answer({"ids": [[ids[i] for i in order]], "engine": "stale", "took_ms": 0, "fallback": None,
                      "consistency": body.get("consistency", "bounded"), "watermark": self.seq})


def test_mixed_counts_deleted_ids_returned_as_errors(tmp_path: Path) -> None:
    data = datasets.VectorData(*datasets.mixture(500, 20, 8), metric="l2", source="test")
    folder = datasets.save(tmp_path / "dataset", data, datasets.exact_neighbors(data.base, data.queries, "l2", 10), "c")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StaleService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        subprocess.run([sys.executable, "-m", "locust", "-f", str(Path(runner.__file__).parent / "locustfiles" /
                                                                   "mixed_vectors.py"),
                        "--headless", "-u", "2", "-r", "2", "-t", "4s", "--host", f"http://127.0.0.1:{server.server_port}",
                        "--csv", str(tmp_path / "run"), "--collection", "c", "--dataset", str(folder),
                        "--write-rate", "30", "--tally-out", str(tmp_path / "tally.json"), "--exit-code-on-error", "0"],
                       check=True, timeout=120, capture_output=True)
    finally:
        server.shutdown()
    ryw = read_your_writes(json.loads((tmp_path / "tally.json").read_text()))
    assert sum(ryw[level]["delete_probes"] for level in LEVELS) > 0
    for level in LEVELS:
        assert ryw[level]["delete_gone"] == 0
        assert ryw[level]["deleted_returned"] >= ryw[level]["delete_probes"]
    assert ryw["strong"]["deleted_returned_broken"] > 0
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "deleted id" in failures and "which promised it gone" in failures


def test_spatial_and_olap_runs(service, tmp_path: Path) -> None:
    with service() as url:
        assert runner.main(["spatial", "--url", url, "--points", "3000", "--polygons", "20", "--distance-points", "500",
                            "--users", "2", "--duration", "3", "--out", str(tmp_path / "spatial")]) == 0
        assert runner.main(["olap", "--url", url, "--sf", "0.01", "--users", "2", "--duration", "4",
                            "--sql-share", "0.3", "--out", str(tmp_path / "olap")]) == 0
    spatial = json.loads((tmp_path / "spatial" / "summary.json").read_text())["points"][0]["by_request"]
    assert set(spatial) == {"POST pip counts", "POST pip pairs page", "POST distance page"}
    olap = json.loads((tmp_path / "olap" / "summary.json").read_text())["points"][0]["by_request"]
    assert any(name.startswith("POST ssb Q") for name in olap) and any(name.startswith("POST sql") for name in olap)
    for figures in [*spatial.values(), *olap.values()]:
        assert figures["failures"] == 0 and figures["count"] > 0
    for folder in ("spatial", "olap"):
        assert (tmp_path / folder / "latency_vs_users.png").stat().st_size > 0


def test_ssb_parameters_are_valid_and_varied() -> None:
    from olap.queries import describe, validate_params
    from olap.sqlguard import check

    r = random.Random(3)
    assert set(GENERATORS) == {q["id"] for q in describe()}
    for query_id in GENERATORS:
        drawn = [random_params(query_id, r) for _ in range(300)]
        for params in drawn:
            validate_params(query_id, params)  # raises on a value outside the template's domain
        assert len({json.dumps(p, sort_keys=True) for p in drawn}) > 10, query_id
    for _ in range(30):
        check(random_sql(r)[1])


def test_latency_percentiles_from_tally_buckets() -> None:
    rng = np.random.default_rng(0)
    latencies_ms = rng.lognormal(0, 1, 20_000)
    tally: dict[str, int] = {}
    for ms in latencies_ms:
        key = f"latency:POST search:{latency_bucket(ms)}"
        tally[key] = tally.get(key, 0) + 1
    got = percentiles(tally, "POST search", (50, 99))
    for q in (50, 99):
        assert got[f"p{q}_ms"] == pytest.approx(np.percentile(latencies_ms, q), rel=0.02)
