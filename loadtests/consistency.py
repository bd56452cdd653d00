"""A history checker for Switchyard's vector collections, in the manner of Jepsen and Elle.

    python loadtests/consistency.py                          # 4 workers, 8 clients, 60 s
    python loadtests/consistency.py --ops 100000 --workers 4 --clients 8
    python loadtests/consistency.py --url http://host:8000   # a running service (rebuild settings are its own)
    python loadtests/consistency.py --levels none            # a server without consistency levels

Concurrent clients run upserts, re-upserts, deletes, builds and k=1 searches by stored vectors, at random
consistency levels, against one exact collection; the recorded history is then checked for deleted-returned,
lost-write, stale-vector, phantom and error anomalies at each level's cut-off, and every replica's content digest
against PostgreSQL's. Exits non-zero on any anomaly. The rules: docs/design/verification.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import numpy as np

from switchyard_client import Client, JobFailed, NotFound, RetryPolicy, SwitchyardError, TransportError
from switchyard_client.errors import PREFIX

sys.path.insert(0, str(Path(__file__).resolve().parent))

LEVELS = ("strong", "session", "bounded", "eventually")
# A search by a stored vector finds it at distance 0, float32 rounding aside. Exact search over a masked or batched
# set expands |q - x|^2 as |q|^2 - 2 q.x + |x|^2, which keeps about one ulp of |q|^2 + |x|^2 (2^-18 at dim 16) and
# reports its square root, 2^-9; a stale vector here is another standard normal vector, sqrt(2 * dim) away.
ZERO = 0.05


NOT_RUN = ("overloaded", "quota-exceeded", "deadline-exceeded", "engine-cooling-down")  # refusals: nothing done
# The checker records each call as sent once: a call resent after a refusal would stretch one operation over two
# sendings (harmless for idempotent writes, but the history should say what was sent).
NO_RETRIES = RetryPolicy(max_retries=0)
T = TypeVar("T")


@dataclass
class Op:
    """One invocation and, if it got an answer, its completion."""

    client: int
    kind: str  # upsert | delete | search | build
    ids: list[int]
    invoke: float
    complete: float | None = None  # None: no answer; the operation may or may not have taken effect
    ok: bool = False
    status: int | None = None
    seq: int | None = None  # change sequence of a write (upserts, deletes)
    tokens: list[int] | None = None  # upsert: the vector of each id (a row of the checker's vector table)
    level: str | None = None  # search: consistency level asked for ("none": not sent)
    query: int | None = None  # search: the vector token used as the query
    found: int | None = None  # search: the id returned (None: nothing)
    distance: float | None = None
    watermark: int | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Refused with a 4xx, or shed by admission control (503 or 429 saying it was not run): certainly not
        applied."""
        return self.status is not None and (400 <= self.status < 500 or self.refused)

    @property
    def refused(self) -> bool:
        """Shed before it ran (docs/operations.md: Overload): a definite failure, not an anomaly."""
        return self.status in (429, 503) and any(f"problem:{slug}" in (self.error or "") for slug in NOT_RUN)


# -- the checker ----------------------------------------------------------------------------------------
@dataclass
class State:
    """What the history says an id holds at a search's cut-off."""

    kind: str  # present | absent | never | ambiguous
    token: int | None = None


class History:
    def __init__(self, ops: Iterable[Op]) -> None:
        self.ops = sorted(ops, key=lambda o: o.invoke)
        self.writes: dict[int, list[Op]] = defaultdict(list)
        for op in self.ops:
            if op.kind in ("upsert", "delete") and not op.failed:
                for i in op.ids:
                    self.writes[i].append(op)

    def state(self, id_: int, cutoff: float, until: float) -> State:
        """The id's state for a search whose cut-off is `cutoff` and which completed at `until`: ambiguous if a
        write of the id was in flight (invoked before `until`, not completed before `cutoff`)."""
        known = []
        for w in self.writes.get(id_, ()):
            if w.ok and w.complete is not None and w.complete < cutoff:
                known.append(w)
            elif w.invoke < until:
                return State("ambiguous")
        if not known:
            return State("never")
        # The last write: the ones no other known write certainly follows (in real time), ordered by seq.
        latest_invoke = max(w.invoke for w in known)
        last = [w for w in known if w.complete >= latest_invoke]
        if any(w.seq is None for w in last) and len({_effect(w, id_) for w in last}) > 1:
            return State("ambiguous")  # overlapping writes without a seq to order them
        top = max(w.seq for w in last)
        if len({_effect(w, id_) for w in last if w.seq == top}) > 1:
            return State("ambiguous")  # one group commit carried both: the order they reached the server decided
        w = max(last, key=lambda w: (w.seq if w.seq is not None else -1, w.kind == "upsert"))
        kind, token = _effect(w, id_)
        return State(kind, token)

    def check(self, bound_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Anomalies found, and counts of what was judged per level."""
        anomalies: list[dict[str, Any]] = []
        judged: Counter = Counter()
        for s in self.ops:
            if s.kind != "search":
                continue
            if not s.ok:
                if (s.status is None or s.status >= 500) and not s.refused:
                    anomalies.append(_anomaly("error", s, f"search failed: {s.error}"))
                continue
            if s.level == "eventually":
                judged["eventually (not judged)"] += 1
                continue
            cutoff = s.invoke - bound_s if s.level == "bounded" else s.invoke
            judged[s.level] += 1
            x = s.ids[0]
            sx = self.state(x, cutoff, s.complete)
            if sx.kind == "present" and sx.token == s.query:
                if s.found != x:
                    anomalies.append(_anomaly("lost-write", s, f"id {x} was acknowledged with this vector and not "
                                              f"found (got {s.found})", self._writes_of(s, x, s.found)))
                elif s.distance is not None and s.distance > ZERO:
                    anomalies.append(_anomaly("stale-vector", s, f"id {x} found at distance {s.distance:.4g}, not 0",
                                              self._writes_of(s, x)))
            if s.found is None:
                continue
            sy = sx if s.found == x else self.state(s.found, cutoff, s.complete)
            if sy.kind == "absent":
                anomalies.append(_anomaly("deleted-returned", s, f"id {s.found} was deleted before the search",
                                          self._writes_of(s, s.found)))
            elif sy.kind == "never":
                anomalies.append(_anomaly("phantom", s, f"id {s.found} was never stored before the search",
                                          self._writes_of(s, s.found)))
        for op in self.ops:
            if op.kind != "search" and not op.ok and (op.status is None or op.status >= 500) and not op.refused:
                anomalies.append(_anomaly("error", op, f"{op.kind} failed: {op.error}"))
        return anomalies, dict(judged)

    def _writes_of(self, s: Op, *ids: int | None) -> list[dict[str, Any]]:
        """The writes of these ids invoked before the search completed: the last few of each."""
        out = []
        for i in dict.fromkeys(i for i in ids if i is not None):
            out += [_brief(w) for w in self.writes.get(i, ()) if w.invoke < s.complete][-4:]
        return out


def _effect(w: Op, id_: int) -> tuple[str, int | None]:
    if w.kind == "delete":
        return "absent", None
    return "present", w.tokens[w.ids.index(id_)]


def _brief(op: Op) -> dict[str, Any]:
    out = {k: v for k, v in asdict(op).items() if v is not None and k != "client"}
    for t in ("invoke", "complete"):
        if t in out:
            out[t] = round(out[t], 4)
    return out


def _anomaly(kind: str, op: Op, detail: str, involved: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"kind": kind, "detail": detail, "op": _brief(op), "involved": involved or []}


def summarize(anomalies: list[dict[str, Any]], examples: int = 3) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in anomalies:
        by_kind[a["kind"]].append(a)
    return {kind: {"count": len(items), "examples": items[:examples]} for kind, items in sorted(by_kind.items())}


# -- the workload ---------------------------------------------------------------------------------------
@dataclass
class Config:
    url: str
    collection: str = "consistency"
    clients: int = 8
    duration_s: float = 30.0
    max_ops: int | None = None
    n_ids: int = 2000
    dim: int = 16
    levels: tuple[str, ...] = LEVELS
    weights: dict[str, float] = field(default_factory=lambda: {"search": 0.6, "upsert": 0.28, "delete": 0.12})
    build_every_s: float = 2.0
    reconnect_p: float = 0.05
    settle_s: float = 3.0
    seed: int = 0
    api_key: str | None = None


class Workload:
    def __init__(self, config: Config) -> None:
        self.c = config
        self.lock = threading.Lock()
        self.ops: list[Op] = []
        self.vectors: list[np.ndarray] = []  # token -> vector
        self.latest: dict[int, tuple[int, int]] = {}  # id -> (seq, token) of its latest acknowledged upsert
        self.seq_in_hand = 0
        self.stop = threading.Event()
        self.count = 0
        self.rng = np.random.default_rng(config.seed)

    # -- plumbing -------------------------------------------------------------------------------------
    def _client(self) -> Client:
        """The project's own client (switchyard_client), as its users call the service; one per thread."""
        return Client(self.c.url, api_key=self.c.api_key, timeout=30, retry=NO_RETRIES, max_idle_connections=1)

    def _new_vectors(self, n: int) -> list[int]:
        with self.lock:
            start = len(self.vectors)
            self.vectors.extend(self.rng.standard_normal((n, self.c.dim)).astype(np.float32))
            return list(range(start, start + n))

    def _record(self, op: Op) -> bool:
        with self.lock:
            self.ops.append(op)
            if op.kind != "build":
                self.count += 1
            if op.ok and op.seq is not None:
                self.seq_in_hand = max(self.seq_in_hand, op.seq)
                if op.kind == "upsert":
                    for i, t in zip(op.ids, op.tokens):
                        if op.seq > self.latest.get(i, (-1, 0))[0]:
                            self.latest[i] = (op.seq, t)
                elif op.kind == "delete":
                    for i in op.ids:
                        if op.seq > self.latest.get(i, (-1, 0))[0]:
                            self.latest.pop(i, None)
            done = self.c.max_ops is not None and self.count >= self.c.max_ops
        if done:
            self.stop.set()
        return not done

    @staticmethod
    def _call(op: Op, call: Callable[[], T]) -> T | None:
        """Run one client call for `op`: its answer, or None with the op's status and error recorded (a transport
        failure leaves it without a completion: it may or may not have taken effect)."""
        try:
            answer = call()
        except SwitchyardError as exc:
            op.status, op.complete = exc.status, time.monotonic()
            op.error = f"{PREFIX}{exc.type}: {exc.detail}"[:300]  # `refused` reads the problem type from it
            return None
        except JobFailed as exc:
            op.complete, op.error = time.monotonic(), str(exc)[:300]
            return None
        except TransportError as exc:
            op.error = f"{type(exc).__name__}: {exc}"
            return None
        op.complete, op.ok = time.monotonic(), True
        return answer

    # -- operations -----------------------------------------------------------------------------------
    def upsert(self, sy: Client, client: int, rnd: random.Random) -> Op:
        ids = rnd.sample(range(self.c.n_ids), rnd.randint(1, 4))
        tokens = self._new_vectors(len(ids))
        vectors = np.stack([self.vectors[t] for t in tokens])
        op = Op(client, "upsert", ids, time.monotonic(), tokens=tokens)
        written = self._call(op, lambda: sy.upsert(self.c.collection, ids, vectors))
        if written is not None:
            op.seq = written.seq
        return op

    def delete(self, sy: Client, client: int, rnd: random.Random) -> Op:
        with self.lock:
            stored = list(self.latest)
        pool = stored if stored and rnd.random() < 0.8 else range(self.c.n_ids)
        ids = rnd.sample(list(pool), min(len(pool), rnd.randint(1, 4)))
        op = Op(client, "delete", ids, time.monotonic())
        written = self._call(op, lambda: sy.delete(self.c.collection, ids))
        if written is not None:
            op.seq = written.seq
        return op

    def search(self, sy: Client, client: int, rnd: random.Random) -> Op | None:
        with self.lock:
            if not self.latest:
                return None
            x = rnd.choice(list(self.latest))
            token = self.latest[x][1]
            seq_in_hand = self.seq_in_hand
        level = rnd.choice(self.c.levels)
        # "none": no level sent, the service's default ("default" tells the client so, whatever it wrote before)
        consistency = "default" if level == "none" else level
        seq = seq_in_hand if level == "session" else None
        op = Op(client, "search", [x], time.monotonic(), level=level, query=token)
        answer = self._call(op, lambda: sy.search(self.c.collection, self.vectors[token], k=1, engine="auto",
                                                  consistency=consistency, seq=seq))
        if answer is not None:
            if len(answer.ids) and answer.ids[0] >= 0:  # a short answer is padded with id -1
                op.found, op.distance = int(answer.ids[0]), float(answer.distances[0])
            op.watermark = answer.watermark
        return op

    def build(self, sy: Client) -> Op:
        op = Op(-1, "build", [], time.monotonic())
        self._call(op, lambda: sy.build(self.c.collection))
        return op

    # -- loops ----------------------------------------------------------------------------------------
    def client_loop(self, client: int) -> None:
        rnd = random.Random(self.c.seed * 1000 + client)
        kinds, weights = zip(*self.c.weights.items())
        sy = self._client()
        try:
            while not self.stop.is_set():
                if rnd.random() < self.c.reconnect_p:  # a fresh connection: it may land on another worker
                    sy.close()
                    sy = self._client()
                kind = rnd.choices(kinds, weights)[0]
                op = getattr(self, kind)(sy, client, rnd)
                if op is not None and not self._record(op):
                    return
        finally:
            sy.close()

    def build_loop(self) -> None:
        with self._client() as sy:
            while not self.stop.wait(self.c.build_every_s):
                self._record(self.build(sy))

    def run(self) -> None:
        with self._client() as sy:
            try:
                sy.delete_collection(self.c.collection)
            except NotFound:
                pass
            sy.create_collection(self.c.collection, self.c.dim, "l2", index={"type": "brute_force"},
                                 pgvector_index={"type": "none"})
        threads = [threading.Thread(target=self.client_loop, args=(i,), daemon=True) for i in range(self.c.clients)]
        if self.c.build_every_s > 0:
            threads.append(threading.Thread(target=self.build_loop, daemon=True))
        for t in threads:
            t.start()
        started = time.monotonic()
        deadline = started + self.c.duration_s if self.c.max_ops is None else float("inf")
        while not self.stop.wait(min(5.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            goal = f"/{self.c.max_ops}" if self.c.max_ops else f" in {self.c.duration_s:g} s"
            print(f"\r  {self.count} operations{goal}, {self.count / (time.monotonic() - started):.0f}/s ",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        self.stop.set()
        for t in threads:
            t.join()

    def final_digests(self, workers: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """After writes stop and the settle time passes, every worker's digest must equal PostgreSQL's."""
        time.sleep(self.c.settle_s)
        with self._client() as sy:
            info = sy.get_collection(self.c.collection, verify=True)
        replication = info.get("replication")
        if replication is None:
            return [], {"checked": False, "why": "the server reports no replication state"}
        pg = replication["postgres"]
        anomalies = []
        replicas = replication["replicas"]
        for rep in replicas:
            if rep.get("digest") != pg["digest"] or rep.get("rows") != pg["rows"]:
                anomalies.append({"kind": "digest-mismatch", "detail": (
                    f"process {rep['pid']} has digest {rep.get('digest')} over {rep.get('rows')} rows at watermark "
                    f"{rep.get('watermark')}; PostgreSQL has {pg['digest']} over {pg['rows']} rows at seq {pg['seq']}"),
                    "op": rep, "involved": []})
        if workers and len(replicas) < workers:
            anomalies.append({"kind": "replica-missing", "detail": f"{len(replicas)} of {workers} workers reported",
                              "op": {"replicas": replicas}, "involved": []})
        return anomalies, {"checked": True, "postgres": pg, "replicas": replicas}


def run_check(config: Config, workers: int, bound_s: float) -> dict[str, Any]:
    """Run the workload, check the history and the final digests; the report as a dict."""
    w = Workload(config)
    started = time.monotonic()
    w.run()
    elapsed = time.monotonic() - started
    anomalies, judged = History(w.ops).check(bound_s)
    digest_anomalies, digests = w.final_digests(workers)
    anomalies += digest_anomalies
    kinds = Counter(op.kind for op in w.ops)
    return {
        "operations": len(w.ops), "by_kind": dict(kinds), "seconds": round(elapsed, 1),
        "ops_per_s": round(len(w.ops) / elapsed, 1), "judged": judged,
        "builds_ok": sum(1 for op in w.ops if op.kind == "build" and op.ok),
        "refused": sum(1 for op in w.ops if op.refused),
        "anomalies": len(anomalies), "by_anomaly": summarize(anomalies), "digests": digests,
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"}, "workers": workers, "bound_s": bound_s,
    }


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['operations']} operations in {report['seconds']} s ({report['ops_per_s']}/s): {report['by_kind']}")
    print(f"searches judged per level: {report['judged']}; builds completed: {report['builds_ok']}; refused by "
          f"admission control (not run): {report['refused']}")
    if report["digests"].get("checked"):
        pg = report["digests"]["postgres"]
        replicas = report["digests"]["replicas"]
        print(f"PostgreSQL: {pg['rows']} rows, seq {pg['seq']}, digest {pg['digest']}; {len(replicas)} worker(s) "
              f"reported, digests {sorted({r.get('digest') for r in replicas})}")
        print(f"background and asked-for rebuilds per worker: {[r.get('rebuilds') for r in replicas]}, rows changed "
              f"during them and carried over: {[r.get('rebuild_carried_rows') for r in replicas]}, another "
              f"worker's rebuild taken from its snapshot instead: {[r.get('adopted') for r in replicas]}")
    else:
        print(f"final digests not checked: {report['digests'].get('why')}")
    if not report["anomalies"]:
        print("no anomalies")
        return
    print(f"{report['anomalies']} anomalies:")
    for kind, entry in report["by_anomaly"].items():
        print(f"  {kind}: {entry['count']}")
        for example in entry["examples"][:2]:
            print(f"    - {example['detail']}")
            print(f"      op: {json.dumps(example['op'])[:400]}")
            for inv in example["involved"][-4:]:
                print(f"      involved: {json.dumps(inv)[:300]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running service (default: start one with embedded PostgreSQL)")
    p.add_argument("--workers", type=int, default=4, help="Uvicorn workers of the service started here")
    p.add_argument("--engines", type=int, default=0, help=(
        "instead of workers: this many engine processes behind two front processes (the one-engine-per-device "
        "layout), each a replica checked as a worker is"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="seconds (ignored with --ops)")
    p.add_argument("--ops", type=int, help="stop after this many operations")
    p.add_argument("--ids", type=int, default=2000, help="size of the id space the clients write to")
    p.add_argument("--levels", default=",".join(LEVELS),
                   help="consistency levels to pick from per search; 'none' sends none (judged as strong)")
    p.add_argument("--bound-ms", type=float, default=1000.0, help="the service's bounded-staleness limit")
    p.add_argument("--build-every", type=float, default=2.0, help="seconds between explicit builds (0: none)")
    p.add_argument("--rebuild-dead-fraction", type=float, default=0.02,
                   help="service started here: rebuild when dead rows exceed this share (default 0.02: often)")
    p.add_argument("--rebuild-delta-rows", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path,
                   help="JSON report (default: results_dir('consistency')/consistency-<time>.json, "
                        "loadtests/processes.py)")
    args = p.parse_args(argv)
    levels = tuple(args.levels.split(","))
    if unknown := set(levels) - set(LEVELS) - {"none"}:
        p.error(f"unknown level(s): {sorted(unknown)}")
    service = None
    url = args.url
    workers = 0 if args.url else args.engines or args.workers
    if url is None:
        from benchkit import Service

        tmp = Path(tempfile.mkdtemp(prefix="switchyard-consistency-"))
        (tmp / "data").mkdir()
        layout = ({"SWITCHYARD_ENGINES": str(args.engines), "SWITCHYARD_FRONTS": "2"} if args.engines
                  else {"SWITCHYARD_WORKERS": str(args.workers)})
        service = Service(tmp / "data", env={
            **layout, "SWITCHYARD_BOUNDED_STALENESS_MS": str(args.bound_ms),
            "SWITCHYARD_REBUILD_DEAD_FRACTION": str(args.rebuild_dead_fraction),
            "SWITCHYARD_REBUILD_DELTA_ROWS": str(args.rebuild_delta_rows)})
        print(f"starting the service with {workers} {'engine processes' if args.engines else 'workers'} in {tmp} ...",
              flush=True)
        service.start()
        url = service.url
    config = Config(url=url, clients=args.clients, duration_s=args.duration, max_ops=args.ops, n_ids=args.ids,
                    levels=levels, build_every_s=args.build_every, seed=args.seed,
                    settle_s=max(3.0, 3 * args.bound_ms / 1000))
    try:
        report = run_check(config, workers, args.bound_ms / 1000)
    finally:
        if service is not None:
            service.stop()
    print_report(report)
    from processes import results_dir  # a sibling module: this folder is on sys.path

    out = args.out or results_dir("consistency") / f"consistency-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {out}")
    return 1 if report["anomalies"] else 0


if __name__ == "__main__":
    sys.exit(main())
