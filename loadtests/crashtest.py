"""Crash test: SIGKILL the service at random points of upserts, deletes, index builds (each ends by writing a
snapshot) and SSB loads, restart it on the same data directory, and check that nothing acknowledged was lost.

    python loadtests/crashtest.py --kills 50

After each restart it checks PostgreSQL (every acknowledged write there, no acknowledged delete undone), the
resident index (snapshot plus change-log replay finds every acknowledged id, returns no deleted one, digest equal
to PostgreSQL's), jobs (none left queued or running) and SSB datasets (only complete ones). A JSON report goes to
results_dir("crash"). The checks in detail: docs/design/verification.md#the-crash-test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from loadtests.processes import embedded_postgres, free_port, results_dir  # noqa: E402

DIM = 8
WRITERS = 3
IDS_PER_WRITER = 400
# HNSW is approximate even at ef 512: on these 8-d rows about one id in 50,000 is missed by its own vector (seen in
# CI, then found by ef 4096 and by exact search). A damaged index misses far more than this share.
MAX_INDEX_MISSES = 0.01
Absent = None  # an id's state: None (absent) or the version of its vector and payload


def vector(id_: int, version: int) -> list[float]:
    rng = np.random.default_rng(id_ * 1_000_003 + version)
    return rng.normal(size=DIM).astype(np.float32).tolist()


@dataclass
class Ledger:
    """What each id may hold: one state once a write is acknowledged, more while writes are in doubt."""
    states: dict[int, list[int | None]] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)

    def possible(self, id_: int) -> list[int | None]:
        return self.states.get(id_, [Absent])

    def begin(self, ids: list[int], state_of) -> list[int | None]:
        new = [state_of(i) for i in ids]
        for i, s in zip(ids, new):
            self.states[i] = [*self.possible(i), s]
        return new

    def acknowledged(self, ids: list[int], new: list[int | None]) -> None:
        for i, s in zip(ids, new):
            self.states[i] = [s]

    def refused(self, ids: list[int], new: list[int | None]) -> None:  # a 4xx: certainly not applied
        for i, s in zip(ids, new):
            self.states[i].remove(s)


class Writer(threading.Thread):
    def __init__(self, url: str, ledger: Ledger, owned: range, rng: random.Random, stop: threading.Event,
                 inflight: dict[str, int], lock: threading.Lock) -> None:
        super().__init__(daemon=True)
        self.url, self.ledger, self.owned, self.rng, self.stop = url, ledger, owned, rng, stop
        self.inflight, self.lock = inflight, lock
        self.acked = self.doubt = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                ids = sorted(self.rng.sample(self.owned, self.rng.randint(1, 20)))
                upsert = self.rng.random() < 0.7
                kind = "upsert" if upsert else "delete"
                if upsert:
                    new = self.ledger.begin(ids, self._next_version)
                    request = ("PUT", "/v1/collections/c/points", {
                        "ids": ids, "vectors": [vector(i, v) for i, v in zip(ids, new)],
                        "payloads": [{"v": v} for v in new]})
                else:
                    new = self.ledger.begin(ids, lambda i: Absent)
                    request = ("POST", "/v1/collections/c/points/delete", {"ids": ids})
                with self.lock:
                    self.inflight[kind] += 1
                try:
                    r = http.request(request[0], request[1], json=request[2])
                except httpx.HTTPError:
                    self.doubt += 1
                    return  # the service is gone: this write stays in doubt
                finally:
                    with self.lock:
                        self.inflight[kind] -= 1
                if r.status_code < 300:
                    self.ledger.acknowledged(ids, new)
                    self.acked += 1
                elif r.status_code < 500 and r.status_code != 429:
                    self.ledger.refused(ids, new)
                    raise AssertionError(f"{kind} refused: {r.status_code} {r.text[:300]}")
                else:
                    self.doubt += 1  # 503/504 or 429: not acknowledged; whether it ran is not ours to assume

    def _next_version(self, id_: int) -> int:
        self.ledger.versions[id_] = self.ledger.versions.get(id_, 0) + 1
        return self.ledger.versions[id_]


class Jobs(threading.Thread):
    """Index builds (each writes a snapshot when it ends) and, in some rounds, an SSB generation."""

    def __init__(self, url: str, ssb: bool, stop: threading.Event, inflight: dict[str, int],
                 lock: threading.Lock, started: list[str]) -> None:
        super().__init__(daemon=True)
        self.url, self.ssb, self.stop, self.inflight, self.lock, self.started = url, ssb, stop, inflight, lock, started

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=30) as http:
                running: dict[str, str] = {}
                if self.ssb:
                    self._start(http, running, "ssb", "POST", "/v1/olap/ssb/generate",
                                {"scale_factor": 0.01, "seed": random.randint(0, 1000)})
                while not self.stop.is_set():
                    if "build" not in running.values():
                        self._start(http, running, "build", "POST", "/v1/collections/c/build", None)
                    for job, kind in list(running.items()):
                        if http.get(f"/v1/jobs/{job}").json()["state"] not in ("queued", "running"):
                            del running[job]
                            with self.lock:
                                self.inflight[kind] -= 1
                    time.sleep(0.05)
        except httpx.HTTPError:
            pass  # killed

    def _start(self, http: httpx.Client, running: dict[str, str], kind: str, method: str, path: str, body) -> None:
        r = http.request(method, path, json=body)
        if r.status_code == 202:
            job = r.json()["job"]
            self.started.append(job)
            running[job] = kind
            with self.lock:
                self.inflight[kind] += 1


class Service:
    def __init__(self, database_url: str, data_dir: Path, log_path: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
        self.env.update({"SWITCHYARD_DATABASE_URL": database_url, "SWITCHYARD_ACCESS_LOG": "false",
                         "SWITCHYARD_LOG_LEVEL": "warning", "SWITCHYARD_REBUILD_DELTA_ROWS": "200"})
        self.data_dir, self.log_path = data_dir, log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> float:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port),
                                          "--data-dir", str(self.data_dir)], env=self.env, stdout=log, stderr=log,
                                         start_new_session=True)  # its own process group: killed whole
        started = time.monotonic()
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() - started > 120:
                raise RuntimeError(f"the service did not come back (exit {self.proc.poll()}): see {self.log_path}")
            time.sleep(0.1)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


def check_postgres(database_url: str, ledger: Ledger) -> dict:
    async def rows() -> dict[int, tuple[str, str]]:
        conn = await asyncpg.connect(database_url)
        try:
            table = f"vectors_{await conn.fetchval('SELECT id FROM vector_collections WHERE name = $1', 'c')}"
            return {r["id"]: (r["e"], r["p"]) for r in await conn.fetch(
                f"SELECT id, embedding::text AS e, payload->>'v' AS p FROM {table}")}
        finally:
            await conn.close()

    stored = asyncio.run(rows())
    problems = []
    for id_ in range(WRITERS * IDS_PER_WRITER):
        possible = ledger.possible(id_)
        if id_ not in stored:
            if Absent not in possible:
                problems.append(f"id {id_} lost: expected version {possible}")
            continue
        text, payload = stored[id_]
        version = int(payload)
        got = np.array(json.loads(text), np.float32)
        if version not in possible:
            problems.append(f"id {id_} holds version {version}, expected one of {possible}")
        elif not np.array_equal(got, np.array(vector(id_, version), np.float32)):
            problems.append(f"id {id_}: its vector is not version {version}'s")
    return {"rows": len(stored), "problems": problems}


def check_service(url: str, ledger: Ledger) -> dict:
    ids = range(WRITERS * IDS_PER_WRITER)
    present = [i for i in ids if len(ledger.possible(i)) == 1 and ledger.possible(i)[0] is not Absent]
    deleted = {i for i in ids if ledger.possible(i) == [Absent]}
    problems = []
    index_misses = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        queries = [vector(i, ledger.possible(i)[0]) for i in present]
        # Every deleted id's former vectors too: a deleted id must not come back for its own vector.
        gone = [(i, v) for i in sorted(deleted) for v in range(1, ledger.versions.get(i, 0) + 1)][:2000]
        for engine in ("cpu", "pgvector"):
            for start in range(0, max(len(queries), 1), 1000):
                batch = queries[start:start + 1000]
                if not batch:
                    break
                # The resident index is HNSW (approximate): a wide search, and a miss is checked by exact search.
                params = {"ef": 512} if engine == "cpu" else None
                r = http.post("/v1/collections/c/search", json={"vectors": batch, "k": 10, "engine": engine,
                                                                "params": params, "consistency": "strong"})
                if r.status_code != 200:
                    problems.append(f"{engine} search answered {r.status_code}: {r.text[:200]}")
                    break
                for i, found in zip(present[start:start + 1000], r.json()["ids"]):
                    if i not in found:
                        if engine == "cpu" and found_exactly(http, i, ledger.possible(i)[0]):
                            index_misses += 1  # the row is there: the graph search missed it (recall, not loss)
                        else:
                            problems.append(f"{engine}: acknowledged id {i} not found by its own vector")
                    if deleted & set(found):
                        problems.append(f"{engine}: deleted ids {sorted(deleted & set(found))} returned")
            for start in range(0, len(gone), 1000):
                batch = gone[start:start + 1000]
                r = http.post("/v1/collections/c/search", json={"vectors": [vector(i, v) for i, v in batch],
                                                                "k": 10, "engine": engine, "consistency": "strong"})
                if r.status_code != 200:
                    problems.append(f"{engine} search answered {r.status_code}: {r.text[:200]}")
                    break
                for found in r.json()["ids"]:
                    if deleted & set(found):
                        problems.append(f"{engine}: deleted ids {sorted(deleted & set(found))} returned")
        if index_misses > MAX_INDEX_MISSES * max(len(present), 1):
            problems.append(f"cpu: the HNSW search at ef 512 missed {index_misses} of {len(present)} ids that exact "
                            "search of the same resident rows finds: the index is damaged")
        described = http.get("/v1/collections/c", params={"verify": "true"}).json()
        state = described["index_state"]
        if state.get("error") or not state.get("loaded"):
            problems.append(f"resident index not loaded: {state}")
        postgres = described["replication"]["postgres"]
        for replica in described["replication"]["replicas"]:
            if replica.get("digest") != postgres.get("digest"):
                problems.append(f"replica digest {replica.get('digest')} != PostgreSQL's {postgres.get('digest')}")
        ssb = http.get("/v1/olap/ssb/datasets").json()
        if any(d["active"] for d in ssb):  # both engines answer from what they loaded: a torn load would differ
            answers = [http.post("/v1/olap/ssb/queries/1.1", json={"engine": e}) for e in ("duckdb", "postgres")]
            if any(a.status_code >= 500 for a in answers):
                problems.append(f"SSB Q1.1 failed: {[a.text[:200] for a in answers]}")
            elif all(a.status_code == 200 for a in answers) and answers[0].json()["rows"] != answers[1].json()["rows"]:
                problems.append(f"SSB Q1.1 differs between DuckDB and PostgreSQL: {[a.text[:200] for a in answers]}")
    return {"loaded_from": state.get("loaded_from"), "present_checked": len(present), "index_misses": index_misses,
            "deleted_checked": len(deleted), "problems": problems, "ssb_datasets": len(ssb)}


def found_exactly(http: httpx.Client, id_: int, version: int) -> bool:
    """Whether exact search over the resident rows (a recall target of 1 on a collection too small to calibrate:
    the plan says so) finds the id by its vector: it tells a row the replica lost from one its HNSW graph missed."""
    r = http.post("/v1/collections/c/search", json={"vectors": [vector(id_, version)], "k": 10, "engine": "cpu",
                                                    "recall_target": 1.0, "consistency": "strong"})
    body = r.json() if r.status_code == 200 else {}
    return body.get("plan", {}).get("plan") == "exact" and id_ in body["ids"][0]


def check_jobs(url: str, started: list[str]) -> list[str]:
    problems = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for job in started:
            r = http.get(f"/v1/jobs/{job}")
            if r.status_code == 200 and r.json()["state"] in ("queued", "running"):
                problems.append(f"job {job} is still {r.json()['state']} after the restart")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--min-s", type=float, default=0.3, help="shortest time from ready to kill")
    parser.add_argument("--max-s", type=float, default=2.5, help="longest time from ready to kill")
    parser.add_argument("--ssb-every", type=int, default=4, help="an SSB generation runs in every Nth round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=results_dir("crash"))
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="switchyard-crash-"))
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / time.strftime("crash-%Y%m%d-%H%M%S.json")
    ledger, rounds, failures = Ledger(), [], 0
    with embedded_postgres(folder) as database_url:
        service = Service(database_url, folder / "data", args.out / "crash-service.log")
        service.start()
        httpx.post(service.url + "/v1/collections", json={"name": "c", "dim": DIM, "index": {"type": "hnsw"},
                                                          "pgvector_index": {"type": "none"}}).raise_for_status()
        try:
            for n in range(args.kills):
                stop, lock, started = threading.Event(), threading.Lock(), []
                inflight = {"upsert": 0, "delete": 0, "build": 0, "ssb": 0}
                writers = [Writer(service.url, ledger, range(w * IDS_PER_WRITER, (w + 1) * IDS_PER_WRITER),
                                  random.Random(rng.random()), stop, inflight, lock) for w in range(WRITERS)]
                jobs = Jobs(service.url, n % args.ssb_every == args.ssb_every - 1, stop, inflight, lock, started)
                for t in (*writers, jobs):
                    t.start()
                time.sleep(rng.uniform(args.min_s, args.max_s))
                with lock:
                    at_kill = dict(inflight)
                service.kill()
                stop.set()
                for t in (*writers, jobs):
                    t.join(60)
                back_s = service.start()
                pg = check_postgres(database_url, ledger)
                svc = check_service(service.url, ledger)
                job_problems = check_jobs(service.url, started)
                problems = pg["problems"] + svc["problems"] + job_problems
                failures += bool(problems)
                rounds.append({"kill": n + 1, "in_flight_at_kill": at_kill, "restart_s": round(back_s, 2),
                               "acked_writes": sum(w.acked for w in writers),
                               "writes_in_doubt": sum(w.doubt for w in writers),
                               "rows": pg["rows"], **{k: v for k, v in svc.items() if k != "problems"},
                               "problems": problems[:20]})
                print(f"kill {n + 1}: in flight {at_kill}, back in {back_s:.1f} s, {pg['rows']} rows, "
                      f"{len(problems)} problems", file=sys.stderr)
                for problem in problems[:5]:
                    print(f"  {problem}", file=sys.stderr)
                report_path.write_text(json.dumps({"kills": n + 1, "failed_rounds": failures, "rounds": rounds},
                                                  indent=1))
        finally:
            service.stop()
    shutil.rmtree(folder, ignore_errors=True)
    totals = {k: sum(1 for r in rounds if r["in_flight_at_kill"][k]) for k in ("upsert", "delete", "build", "ssb")}
    summary = {"kills": len(rounds), "failed_rounds": failures, "kills_with_in_flight": totals,
               "acked_writes": sum(r["acked_writes"] for r in rounds),
               "writes_in_doubt": sum(r["writes_in_doubt"] for r in rounds), "report": str(report_path)}
    report_path.write_text(json.dumps({**summary, "rounds": rounds}, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
