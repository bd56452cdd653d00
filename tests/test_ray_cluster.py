"""Switchyard on a local Ray cluster: a head and a second worker node (loopback, started once for this module, in
a temp directory of its own and stopped by its handles: any other Ray of the machine is left alone), vector
collections, SSB and point layers in 2 parts x 2 replicas behind a service process that joined the cluster.

Shard hosts are Ray actors; the tests check answers against numpy (brute force id for id, HNSW by recall), the
layout the API reports, that killing replicas during searches and upserts loses no acknowledged write and
answers every search with a result or a 503 carrying Retry-After, that one SIGKILLed actor of each kind is back
and ready within 30 s, and that `switchyard serve --ray` with its defaults schedules every actor of its own Ray,
is not ready before they are, and has a SIGKILLed ingress replica back within 30 s while the other one answers.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the 'ray' extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtests"))
from benchkit import Service, local_ray_cluster  # noqa: E402

SHARDS, REPLICAS, DIM = 2, 2, 16
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(nodes=2, cpus_per_node=4) as address:
        yield address


@pytest.fixture(scope="module")
def service(ray_address, tmp_path_factory):
    data = tmp_path_factory.mktemp("ray-service") / "data"
    data.mkdir()
    # 2 x 2 for every domain: vector shards, SSB partitions and spatial partitions (12 actors; CPUs are logical).
    svc = Service(data, env={"SWITCHYARD_RAY_ADDRESS": ray_address, "SWITCHYARD_SHARDS": str(SHARDS),
                             "SWITCHYARD_SHARD_REPLICAS": str(REPLICAS), "SWITCHYARD_SHARD_CPUS": "0.25",
                             "SWITCHYARD_OLAP_PARTITIONS": str(SHARDS), "SWITCHYARD_OLAP_REPLICAS": str(REPLICAS),
                             "SWITCHYARD_SPATIAL_PARTITIONS": str(SHARDS),
                             "SWITCHYARD_SPATIAL_REPLICAS": str(REPLICAS),
                             "SWITCHYARD_SHARD_CALL_TIMEOUT_S": "5", "PYTHONPATH": str(ROOT)})
    svc.start(timeout_s=240)
    try:
        yield svc
    finally:
        svc.stop()


def _collection(http: httpx.Client, name: str, index: dict, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, list]:
    http.delete(f"/v1/collections/{name}")
    r = http.post("/v1/collections", json={"name": name, "dim": DIM, "metric": "l2", "index": index,
                                           "pgvector_index": {"type": "none"}})
    assert r.status_code == 201, r.text
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = np.arange(10, 10 + n, dtype=np.int64)
    payloads = [{"band": int(i % 5)} for i in range(n)]
    for start in range(0, n, 1000):
        part = slice(start, start + 1000)
        r = http.put(f"/v1/collections/{name}/points", json={
            "ids": ids[part].tolist(), "vectors": vectors[part].tolist(), "payloads": payloads[part]})
        assert r.status_code == 200, r.text
    return ids, vectors, payloads


def _exact(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(((vectors[None] - queries[:, None]) ** 2).sum(-1), axis=1, kind="stable")[:, :k]


RESTART_S = 30  # a SIGKILLed actor is back and ready within this


def _replica(http: httpx.Client, section: str, part: int, replica: int) -> dict:
    return http.get("/v1/engines").json()[section][part]["replicas"][replica]


def _sigkill_and_wait_back(http: httpx.Client, section: str, part: int = 0, replica: int = 0,
                           during: Callable[[], None] = lambda: None) -> float:
    """SIGKILL one actor's process (by the pid it reports) and wait until Ray restarted it and it reports ready
    again; `during` runs meanwhile (requests whose answers the caller checks). Seconds until it was back."""
    before = _replica(http, section, part, replica)
    assert before.get("ready") and before.get("pid"), before
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    while True:
        during()
        now = _replica(http, section, part, replica)
        if now.get("ready") and now.get("pid") not in (None, before["pid"]):
            return time.monotonic() - killed
        assert time.monotonic() - killed < RESTART_S, f"{section} {part} replica {replica} not back: {now}"
        time.sleep(0.2)


def _ok_or_retry_later(r: httpx.Response) -> None:
    assert r.status_code == 200 or (r.status_code == 503 and "retry-after" in r.headers), (r.status_code, r.text)


def test_sharded_brute_force_equals_exact_search_id_for_id(service):
    with httpx.Client(base_url=service.url, timeout=60) as http:
        ids, vectors, payloads = _collection(http, "exact", {"type": "brute_force"}, 3000, 1)
        r = http.post("/v1/collections/exact/points/delete", json={"ids": ids[::9].tolist()})
        assert r.status_code == 200
        alive = np.ones(len(ids), bool)
        alive[::9] = False
        queries = np.random.default_rng(2).standard_normal((25, DIM)).astype(np.float32)
        r = http.post("/v1/collections/exact/search", json={"vectors": queries.tolist(), "k": 10, "engine": "cpu",
                                                             "consistency": "strong"})
        assert r.status_code == 200, r.text
        assert r.json()["engine"] == "faiss"
        assert r.json()["ids"] == ids[alive][_exact(vectors[alive], queries, 10)].tolist()
        # the same request answered by PostgreSQL (exact without an index) in the same service
        pg = http.post("/v1/collections/exact/search", json={"vectors": queries.tolist(), "k": 10,
                                                              "engine": "pgvector"})
        assert pg.json()["ids"] == r.json()["ids"]
        band = np.array([p["band"] for p in payloads]) == 3
        r = http.post("/v1/collections/exact/search", json={"vector": queries[0].tolist(), "k": 10, "engine": "cpu",
                                                             "filter": {"band": 3}, "consistency": "strong"})
        keep = alive & band
        assert r.json()["ids"] == ids[keep][_exact(vectors[keep], queries[:1], 10)[0]].tolist()
        assert r.json()["plan"]["matched_rows"] == int(keep.sum())

        described = http.get("/v1/collections/exact").json()
        assert [len(s["replicas"]) for s in described["shards"]] == [REPLICAS] * SHARDS
        rows = [s["replicas"][0]["index_state"]["indexed_rows"] + s["replicas"][0]["index_state"]["delta_rows"]
                - s["replicas"][0]["index_state"]["dead_rows"] for s in described["shards"]]
        assert sum(rows) == int(alive.sum()) and min(rows) > 0  # the rows are split, not copied
        # the shard replicas report to the replication section as themselves: digests of their shard's rows
        shard_reports = [r for r in described["replication"]["replicas"] if r.get("shard")]
        assert {r["shard"] for r in shard_reports} <= {"0/2", "1/2"} and shard_reports
        engines = http.get("/v1/engines").json()
        replicas = [r for s in engines["shards"] for r in s["replicas"]]
        assert len({r["pid"] for r in replicas}) == SHARDS * REPLICAS and all(r["ready"] for r in replicas)
        assert len({r["node"] for r in replicas}) == 2  # spread over both Ray nodes


def test_sharded_hnsw_keeps_its_recall(service):
    with httpx.Client(base_url=service.url, timeout=60) as http:
        ids, vectors, _ = _collection(http, "approx", {"type": "hnsw", "params": {"m": 16, "ef_construction": 64}},
                                      4000, 3)
        assert http.post("/v1/collections/approx/build").status_code in (200, 202)
        queries = np.random.default_rng(4).standard_normal((50, DIM)).astype(np.float32)
        deadline = time.monotonic() + 60
        while True:
            r = http.post("/v1/collections/approx/search", json={
                "vectors": queries.tolist(), "k": 10, "engine": "cpu", "consistency": "strong"})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        truth = ids[_exact(vectors, queries, 10)]
        hits = sum(len(set(got) & set(want)) for got, want in zip(r.json()["ids"], truth.tolist()))
        assert hits / truth.size >= 0.9


def _unready_replicas(http: httpx.Client) -> list[dict]:
    """The shard replicas that do not report ready, as /v1/engines describes them."""
    shards = http.get("/v1/engines").json()["shards"]
    return [{"shard": s["shard"], **r} for s in shards for r in s["replicas"] if not r.get("ready")]


def _actor_states() -> dict[str, str] | str:
    """What Ray's GCS says of each named actor (ALIVE, RESTARTING, ..., and its restarts), for a failure's message:
    whether a replica
    that is not back is still being restarted by Ray or is up and not loading. (The state API needs the dashboard,
    which the test cluster does without; this reads the GCS table through Ray's private helper.)"""
    try:
        from ray._private.state import actors

        return {a["Name"]: f"{a['State']} after {a['NumRestarts']} restarts" for a in actors().values()
                if a.get("Name")}
    except Exception as exc:  # noqa: BLE001 - only a diagnostic
        return f"unknown ({type(exc).__name__}: {exc})"


def test_killing_replicas_during_traffic_loses_no_acknowledged_write(service, ray_address):
    ray.init(address=ray_address, namespace="switchyard", log_to_driver=False, ignore_reinit_error=True)
    from service.cluster.ray_layer import actor_name

    with httpx.Client(base_url=service.url, timeout=60) as http:
        http.delete("/v1/collections/churn")
        assert http.post("/v1/collections", json={"name": "churn", "dim": DIM, "metric": "l2",
                                                  "index": {"type": "brute_force"},
                                                  "pgvector_index": {"type": "none"}}).status_code == 201
    acked: dict[int, np.ndarray] = {}
    problems: list[str] = []
    counts = {"search_ok": 0, "search_503": 0, "upsert_ok": 0, "kills": 0}
    search_s: list[float] = []
    stop = threading.Event()
    lock = threading.Lock()

    def writer(first: int) -> None:
        rng = np.random.default_rng(first)
        next_id = first
        with httpx.Client(base_url=service.url, timeout=60) as http:
            while not stop.is_set():
                batch = rng.standard_normal((5, DIM)).astype(np.float32)
                ids = list(range(next_id, next_id + 5))
                next_id += 5
                r = http.put("/v1/collections/churn/points", json={"ids": ids, "vectors": batch.tolist()})
                with lock:
                    if r.status_code == 200:
                        acked.update(zip(ids, batch))
                        counts["upsert_ok"] += 1
                    elif not (r.status_code == 503 and "retry-after" in r.headers):
                        problems.append(f"upsert {r.status_code}: {r.text[:200]}")

    def searcher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=service.url, timeout=60) as http:
            while not stop.is_set():
                started = time.perf_counter()
                r = http.post("/v1/collections/churn/search", json={
                    "vector": rng.standard_normal(DIM).tolist(), "k": 5, "engine": "cpu"})
                with lock:
                    search_s.append(time.perf_counter() - started)
                    if r.status_code == 200:
                        counts["search_ok"] += 1
                    elif r.status_code == 503 and "retry-after" in r.headers:
                        counts["search_503"] += 1
                    else:
                        problems.append(f"search {r.status_code}: {r.text[:200]}")

    def killer() -> None:
        rng = random.Random(7)
        while counts["kills"] < 20 and not stop.is_set():
            time.sleep(0.6)
            s, r = rng.randrange(SHARDS), rng.randrange(REPLICAS)
            try:
                ray.kill(ray.get_actor(actor_name(s, SHARDS, r), namespace="switchyard"), no_restart=False)
                counts["kills"] += 1
            except ValueError:
                pass  # between lives: not registered under its name this instant

    threads = [threading.Thread(target=writer, args=(1_000_000 * (i + 1),)) for i in range(2)]
    threads += [threading.Thread(target=searcher, args=(i,)) for i in range(2)]
    kill_thread = threading.Thread(target=killer)
    for t in [*threads, kill_thread]:
        t.start()
    kill_thread.join(timeout=180)
    try:
        with httpx.Client(base_url=service.url, timeout=60) as http:
            deadline = time.monotonic() + 120
            while unready := _unready_replicas(http):  # every replica back from the churn (in its reserved bundle)
                assert time.monotonic() < deadline, f"replicas did not come back: {unready}, Ray: {_actor_states()}"
                time.sleep(0.5)
            # One SIGKILL (not ray.kill) of one replica's process, traffic still running: back within 30 s.
            back_s = _sigkill_and_wait_back(http, "shards", 1, 0)
            time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print(counts, "search ms p50 %.1f p99 %.1f max %.1f" % tuple(1000 * np.quantile(search_s, [0.5, 0.99, 1.0])),
          f"SIGKILLed replica back in {back_s:.1f} s")
    assert counts["kills"] >= 20
    assert not problems, problems[:5]
    assert counts["search_ok"] > 0 and counts["upsert_ok"] > 0

    with httpx.Client(base_url=service.url, timeout=60) as http:
        assert http.get("/readyz").status_code == 200
        ids = np.array(sorted(acked))
        for start in range(0, len(ids), 200):
            part = ids[start:start + 200]
            queries = np.stack([acked[i] for i in part])
            r = http.post("/v1/collections/churn/search", json={"vectors": queries.tolist(), "k": 1, "engine": "cpu",
                                                                 "consistency": "strong"})
            assert r.status_code == 200, r.text
            found = [row[0] for row in r.json()["ids"]]
            assert found == part.tolist()  # every acknowledged write is in the restarted replicas
            assert max(row[0] for row in r.json()["distances"]) < 1e-2


def test_a_deployment_the_cluster_cannot_hold_is_refused_with_the_numbers(ray_address):
    """Actors that the cluster cannot all place: refused with what they need and what the cluster has, and no
    pending group left behind (it would take the CPUs of whatever comes next)."""
    from service.cluster.placement import CannotPlace, Footprint, group_name, reserve

    if not ray.is_initialized():
        ray.init(address=ray_address, namespace="switchyard", log_to_driver=False)
    too_big = Footprint({"vectors": (10, 2)}, 1.0, 0.0)  # 20 CPUs; the module's cluster has 8
    with pytest.raises(CannotPlace, match=r"20 actors x 1 CPU = 20 CPU\(s\) and the cluster has 8 CPU\(s\)"):
        reserve(ray, too_big, "vectors", wait_s=2)
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
               if g["name"] == group_name("vectors", 10, 2))


def _every_part_ready(engines: dict, every_replica: bool = False) -> bool:
    """Every vector shard, SSB partition and spatial partition has a ready replica (all of them: every_replica)."""
    parts = [p for section in ("shards", "partitions", "spatial_partitions") for p in engines.get(section, [])]
    pick = all if every_replica else any
    return bool(parts) and all(pick(r.get("ready") for r in p["replicas"]) for p in parts)


def _ingress_replicas(proc: subprocess.Popen) -> list:
    """The processes of the Ray Serve replicas of the ingress that `serve --ray` (proc) runs."""
    import psutil

    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "ServeReplica:" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass  # gone meanwhile
    return found


class _HalfSentUpserts:
    """Upserts whose body is half sent, on connections of their own: each is accepted by an ingress replica (the
    proxy forwards it at once), which then waits for the rest, so a replica killed meanwhile has them in flight."""

    def __init__(self, url: str, collection: str, n: int = 8) -> None:
        import json

        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.ids = list(range(9_000_000, 9_000_000 + n))
        self.vectors = np.random.default_rng(77).standard_normal((n, DIM)).astype(np.float32)
        self.parts: list[tuple[socket.socket, bytes]] = []
        for i, vector in zip(self.ids, self.vectors):
            body = json.dumps({"ids": [i], "vectors": [vector.tolist()]}).encode()
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(f"PUT /v1/collections/{collection}/points HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
            self.parts.append((sock, body[len(body) // 2:]))

    def finish(self) -> list[tuple[int, bool, str]]:
        """Each request's (status, Retry-After given, body): a request already answered (its replica died) is read
        as it is; the others get the rest of their body first."""
        import http.client
        import select

        answers = []
        for sock, rest in self.parts:
            with sock:
                if not select.select([sock], [], [], 0)[0]:
                    sock.sendall(rest)
                response = http.client.HTTPResponse(sock)
                response.begin()
                answers.append((response.status, response.getheader("retry-after") is not None,
                                response.read().decode(errors="replace")))
        return answers


class _Traffic:
    """Upserts (2 clients) and searches (1 client) against a collection until stopped: every answer with when it
    was asked, acknowledged writes kept."""

    def __init__(self, url: str, collection: str) -> None:
        self.url, self.collection = url, collection
        self.answers: list[tuple[float, str, int | str, bool, str]] = []  # asked at, kind, status, Retry-After, body
        self.acked: dict[int, np.ndarray] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(3)]

    def __enter__(self) -> _Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _client(self, i: int) -> None:
        rng = np.random.default_rng(i)
        next_id = 1_000_000 * (i + 1)
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                asked, ids = time.monotonic(), list(range(next_id, next_id + 5))
                batch = rng.standard_normal((5, DIM)).astype(np.float32)
                try:
                    if i < 2:
                        next_id += 5
                        r = http.put(f"/v1/collections/{self.collection}/points",
                                     json={"ids": ids, "vectors": batch.tolist()})
                    else:
                        r = http.post(f"/v1/collections/{self.collection}/search",
                                      json={"vector": batch[0].tolist(), "k": 5, "engine": "cpu"})
                except httpx.TransportError as exc:
                    with self.lock:
                        self.answers.append((asked, "upsert" if i < 2 else "search", type(exc).__name__, False, ""))
                    time.sleep(0.05)
                    continue
                with self.lock:
                    self.answers.append((asked, "upsert" if i < 2 else "search", r.status_code,
                                         "retry-after" in r.headers, r.text[:120]))
                    if i < 2 and r.status_code == 200:
                        self.acked.update(zip(ids, batch))


def _kill_an_ingress_replica_under_traffic(proc: subprocess.Popen, url: str) -> tuple[float, list]:
    """SIGKILL one of the ingress's Ray Serve replicas while clients upsert and search: Ray Serve starts another,
    which is back when /readyz is 200 from a process that is neither the one killed nor the other replica, within
    RESTART_S. Every acknowledged upsert is found afterwards. (seconds until back, answers that were neither 200
    nor 503 with Retry-After, as (seconds after the kill it was asked, kind, status, body))."""
    with httpx.Client(base_url=url, timeout=60) as http:
        http.delete("/v1/collections/churn")
        assert http.post("/v1/collections", json={"name": "churn", "dim": DIM, "metric": "l2",
                                                  "index": {"type": "brute_force"},
                                                  "pgvector_index": {"type": "none"}}).status_code == 201
        replicas = _ingress_replicas(proc)
        assert len(replicas) == 2, replicas  # the default: one answers while the other restarts
        with _Traffic(url, "churn") as traffic:
            time.sleep(1.0)
            half_sent = _HalfSentUpserts(url, "churn")
            time.sleep(0.5)
            victim, survivor = replicas[0].pid, replicas[1].pid
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            time.sleep(2.0)  # the proxy learns of the death; the body read deadline (10 s) is far
            probes = half_sent.finish()
            while True:
                try:
                    r = http.get("/readyz", timeout=5)
                    if r.status_code == 200 and r.json()["pid"] not in (victim, survivor):
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - killed < RESTART_S, "the killed ingress replica is not back"
                time.sleep(0.2)
            back_s = time.monotonic() - killed
            time.sleep(1.0)
        after = [a for a in traffic.answers if a[0] >= killed]
        assert sum(1 for a in after if a[2] == 200) > 10, after[:5]
        bad = [(round(asked - killed, 2), kind, status, body) for asked, kind, status, retry, body in traffic.answers
               if not (status == 200 or (status == 503 and retry))]
        # The half-sent upserts: those on the killed replica are answered 503 replica-lost with Retry-After (the
        # proxy spreads them over both replicas: all 8 on the survivor has odds of 1 in 256), the others 200.
        lost = [answer for answer in probes if answer[0] == 503]
        assert lost and all(retry and "replica-lost" in body for _, retry, body in lost), probes
        assert all(status == 200 for status, _, _ in probes if status != 503), probes
        for (status, _, _), i, vector in zip(probes, half_sent.ids, half_sent.vectors):
            if status == 200:
                traffic.acked[i] = vector
        ids = np.array(sorted(traffic.acked))
        assert len(ids) > 0
        for start in range(0, len(ids), 200):
            part = ids[start:start + 200]
            r = http.post("/v1/collections/churn/search", json={
                "vectors": np.stack([traffic.acked[i] for i in part]).tolist(), "k": 1, "engine": "cpu",
                "consistency": "strong"})
            assert r.status_code == 200, r.text
            assert [row[0] for row in r.json()["ids"]] == part.tolist()  # no acknowledged write lost
    in_traffic = sum(1 for _, _, status, _, body in traffic.answers if status == 503 and "replica-lost" in body)
    print(f"SIGKILLed ingress replica back and ready in {back_s:.1f} s; {len(traffic.answers)} answers "
          f"({in_traffic} of them 503 replica-lost), half-sent upserts lost with the replica {len(lost)} of "
          f"{len(probes)}; {len(ids)} acknowledged upserts found; neither 200 nor 503 + Retry-After: {bad}")
    return back_s, bad


def test_serve_ray_with_defaults_schedules_every_actor_and_is_ready_only_then(tmp_path):
    """`switchyard serve --ray` with the default layout (2 x 2 vector shards, 2 SSB and 2 spatial partitions, two
    ingress replicas: 10 CPUs) on a Ray of its own, which it sizes for them on this machine whatever its cores:
    every actor is scheduled, /readyz is 200 only once every shard and partition has a ready replica, the same app
    answers, a SIGKILLed ingress replica is back within 30 s while the other answers and no acknowledged write is
    lost, and at SIGINT its Ray is gone (and nothing else: the module's cluster keeps running)."""
    import psutil

    data = tmp_path / "data"
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # its Ray's files (short: socket paths are limited)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "RAY_ADDRESS"))},
           "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--ray", "--port", str(port),
                             "--data-dir", str(data)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                try:
                    ready = http.get("/readyz", timeout=5).status_code == 200
                except httpx.TransportError:
                    ready = False
                if ready:
                    break
                assert time.monotonic() < deadline, "serve --ray not ready in time"
                time.sleep(0.5)
            started = time.monotonic()
            engines = http.get("/v1/engines").json()
            assert _every_part_ready(engines), engines  # ready means every part has a ready replica
            assert [len(engines[s]) for s in ("shards", "partitions", "spatial_partitions")] == [2, 2, 2]
            while not _every_part_ready(engines := http.get("/v1/engines").json(), every_replica=True):
                assert time.monotonic() - started < 120, engines  # every actor scheduled: none stays pending
                time.sleep(0.5)
            pids = {r["pid"] for s in ("shards", "partitions", "spatial_partitions") for p in engines[s]
                    for r in p["replicas"]}
            assert len(pids) == 8
            ids, vectors, _ = _collection(http, "served", {"type": "brute_force"}, 1000, 8)
            queries = np.random.default_rng(9).standard_normal((5, DIM)).astype(np.float32)
            r = http.post("/v1/collections/served/search", json={"vectors": queries.tolist(), "k": 5, "engine": "cpu",
                                                                  "consistency": "strong"})
            assert r.status_code == 200, r.text
            assert r.json()["ids"] == ids[_exact(vectors, queries, 5)].tolist()
        back_s, bad = _kill_an_ingress_replica_under_traffic(proc, url)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert "= 10 CPU(s)" in (tmp_path / "serve.log").read_text()  # what it reserved, said at start
    deadline = time.monotonic() + 30
    while left := [p for p in psutil.process_iter(["cmdline"]) if ray_tmp in " ".join(p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, [p.info["cmdline"][:3] for p in left]
        time.sleep(0.5)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    # Requests in flight on the killed replica are answered 503 replica-lost with Retry-After by Serve's proxy
    # (service/cluster/serve_proxy.py; Ray Serve itself answers them an empty 500): nothing else is allowed.
    assert not bad, bad


def test_deployment_footprint_sizes_the_local_ray_or_refuses_with_the_numbers(tmp_path):
    """What `serve --ray` reserves: every actor of every domain plus the ingress; a local Ray of the cores or
    more, --num-cpus as given (16 on a 2-core machine), and too few refused before anything starts."""
    from service.cluster.placement import CannotPlace, Footprint, local_cpus
    from service.settings import Settings

    settings = Settings(data_dir=tmp_path)
    defaults = Footprint.of(settings, ingress=settings.cluster.ray_ingress_replicas)
    assert (defaults.actors(), defaults.actors("vectors"), defaults.total_cpus) == (8, 4, 10)
    assert str(defaults) == ("vector shards 2 x 2, SSB partitions 2 x 1, spatial partitions 2 x 1: 8 actors x 1 CPU "
                             "+ 2 ingress replica(s) x 1 CPU = 10 CPU(s)")
    assert (local_cpus(defaults, 2), local_cpus(defaults, 16), local_cpus(defaults, 2, 16)) == (10, 16, 16)
    with pytest.raises(CannotPlace, match="10 CPU"):
        local_cpus(defaults, 2, 4)
    small = Footprint({"vectors": (2, 2), "olap": (0, 1), "spatial": (0, 1)}, 0.25, 0, 1)
    assert (small.total_cpus, local_cpus(small, 2), small.bundle()) == (2.0, 2, {"CPU": 0.25})
    assert Footprint({"vectors": (1, 1)}, 0, 0).bundle() == {}  # reserves nothing: placed anywhere

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--ray", "--num-cpus", "4", "--data-dir",
                              str(tmp_path / "data")], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "10 CPU(s)" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "data").exists()  # refused before anything started (no database, no Ray)


def test_ssb_queries_over_partitions_equal_the_one_process_answers(service):
    from olap.duckdb_engine import DuckDBEngine
    from olap.queries import QUERIES

    with httpx.Client(base_url=service.url, timeout=120) as http:
        accepted = http.post("/v1/olap/ssb/generate", json={"scale_factor": 0.02, "seed": 5})
        assert accepted.status_code == 202, accepted.text
        deadline = time.monotonic() + 240
        while (job := http.get(accepted.json()["location"]).json())["state"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert job["state"] == "succeeded", job
        dataset = next(d["path"] for d in http.get("/v1/olap/ssb/datasets").json() if d["active"])
        while not all(r.get("ready") and r.get("dataset") == dataset
                      for p in http.get("/v1/engines").json()["partitions"] for r in p["replicas"]):
            assert time.monotonic() < deadline, http.get("/v1/engines").json()["partitions"]
            time.sleep(0.5)
        while http.get("/readyz").status_code != 200:  # once the ingress's next watch has seen them
            assert time.monotonic() < deadline
            time.sleep(0.2)
        one_process = DuckDBEngine()
        one_process.load(Path(dataset))
        expected = {query_id: one_process.run_query(query_id, None) for query_id in QUERIES}
        for query_id in QUERIES:
            r = http.post(f"/v1/olap/ssb/queries/{query_id}", json={"engine": "auto"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["engine"] == "duckdb" and body["fallback"] is None, body
            assert body["columns"] == expected[query_id].columns and body["rows"] == expected[query_id].rows, query_id

        def query() -> None:  # answered meanwhile: by the other replica, or here (a fallback), or 503 + Retry-After
            r = http.post("/v1/olap/ssb/queries/1.1", json={"engine": "auto"})
            _ok_or_retry_later(r)
            if r.status_code == 200:
                assert r.json()["rows"] == expected["1.1"].rows

        back_s = _sigkill_and_wait_back(http, "partitions", 0, 1, during=query)
        print(f"SIGKILLed SSB partition actor back with its partition loaded in {back_s:.1f} s")
        body = http.post("/v1/olap/ssb/queries/2.1", json={"engine": "auto"}).json()
        assert body["fallback"] is None and body["rows"] == expected["2.1"].rows


def test_point_in_polygon_over_point_partitions_equals_shapely(service):
    from test_spatial_service import (
        ACROSS_ANTIMERIDIAN,
        NEIGHBOUR,
        SQUARE_WITH_HOLE,
        TWO_ISLANDS,
        feature_collection,
        oracle_pairs,
        sample_points,
    )

    lon, lat = sample_points()
    polys = feature_collection(SQUARE_WITH_HOLE, TWO_ISLANDS, ACROSS_ANTIMERIDIAN, NEIGHBOUR)
    truth = oracle_pairs(lon, lat, polys)
    with httpx.Client(base_url=service.url, timeout=120) as http:
        for body in ({"name": "pts", "kind": "points", "lon": lon.tolist(), "lat": lat.tolist()},
                     {"name": "polys", "kind": "polygons", "geojson": polys}):
            http.delete(f"/v1/spatial/layers/{body['name']}")
            assert http.post("/v1/spatial/layers", json=body).status_code == 201
        counts = http.post("/v1/spatial/joins/point-in-polygon", json={"points": "pts", "polygons": "polys"}).json()
        assert counts["fallback"] is None, counts
        expected = {pid: sum(1 for _, p in truth if p == pid) for pid in counts["polygon_ids"]}
        assert dict(zip(counts["polygon_ids"], counts["counts"])) == expected
        assert counts["points"] == len(lon)
        pairs, cursor, pages = set(), None, 0
        while True:  # small pages: the cursor walks every partition in turn
            page = http.post("/v1/spatial/joins/point-in-polygon", json={
                "points": "pts", "polygons": "polys", "mode": "pairs", "page_size": 97, "cursor": cursor}).json()
            assert page["fallback"] is None, page
            pairs |= {tuple(p) for p in page["pairs"]}
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert pairs == truth and pages > 2
        layout = http.get("/v1/engines").json()["spatial_partitions"]
        assert [len(p["replicas"]) for p in layout] == [REPLICAS] * SHARDS
        # a layer written again: the partitions read the new version before answering
        assert http.delete("/v1/spatial/layers/pts").status_code == 204
        assert http.post("/v1/spatial/layers", json={"name": "pts", "kind": "points", "lon": lon[:50].tolist(),
                                                     "lat": lat[:50].tolist()}).status_code == 201
        again = http.post("/v1/spatial/joins/point-in-polygon", json={"points": "pts", "polygons": "polys"}).json()
        assert again["points"] == 50
        assert sum(again["counts"]) == sum(1 for i, _ in truth if i < 50)

        def join() -> None:
            r = http.post("/v1/spatial/joins/point-in-polygon", json={"points": "pts", "polygons": "polys"})
            _ok_or_retry_later(r)
            if r.status_code == 200:
                assert r.json()["counts"] == again["counts"]

        # A restarted partition actor compiles its kernels again (from numba's cache now) and reads the layers.
        back_s = _sigkill_and_wait_back(http, "spatial_partitions", 1, 0, during=join)
        print(f"SIGKILLed spatial partition actor back and warm in {back_s:.1f} s")
        assert http.post("/v1/spatial/joins/point-in-polygon", json={
            "points": "pts", "polygons": "polys"}).json()["fallback"] is None
