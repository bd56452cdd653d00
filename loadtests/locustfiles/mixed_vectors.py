"""Searches while upserts and deletes stream in at a fixed rate (VectorDBBench's streaming case), and
read-your-writes measured from real answers.

- `SearchUser`s (closed loop) search with the dataset's queries and, half the time, with the vector of a point
  deleted a moment ago. An answer holding an id whose delete was acknowledged before the search was sent is
  tallied ("deleted id returned"); it is a failure only where the level promised the id gone (strong, session,
  bounded past its bound: `promised_gone`): within a bounded or eventually level's bound it is what the level
  allows, counted apart (`deleted_returned:<level>` less `deleted_returned_broken:<level>`).
- One `WriterUser` per load-generator process upserts `--write-batch` new points or deletes some of them,
  `--write-rate` times a second, each on a new connection (so a multi-worker service routes them anywhere), and
  right after each acknowledgement probes one consistency level, in turn, with a search on another new
  connection: the upserted vector must come back (RYW "upsert found <level>"), the deleted id must not (RYW
  "delete gone <level>"). Those figures are in % like recall; the tally holds the exact counts. A probe that
  returns the id just deleted is a failure where the level promised it gone, as above.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import numpy as np
import orjson
from locust import FastHttpUser, constant, events, task

from loadtests.locustfiles.common import TALLY, Dataset, auth_headers, b64_rows, fail, fire_figure, worker_index
from loadtests.workloads import LEVELS, promised_gone

STATE: dict[str, Any] = {}
ID_SPACE = 1_000_000_000  # each load-generator process writes ids above rows + ID_SPACE * (worker index + 1)


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("mixed vectors")
    group.add_argument("--collection", default="loadtest")
    group.add_argument("--dataset", default="", help="folder with queries.npy and meta.json")
    group.add_argument("--engine", default="auto")
    group.add_argument("--k", type=int, default=10)
    group.add_argument("--consistency", default="", help="level of the background searches (default: the service's)")
    group.add_argument("--write-rate", type=float, default=20, help="write requests per second per process")
    group.add_argument("--write-batch", type=int, default=10, help="points per upsert")
    group.add_argument("--bound-ms", type=float, default=1000, help="the service's bounded-staleness bound")


@events.test_start.add_listener
def _load(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    data = Dataset(options.dataset) if options.dataset else None
    if data is None:
        return
    rng = np.random.default_rng(1_000_003 + worker_index(environment))
    STATE.update(data=data, rng=rng,
                 next_id=itertools.count(data.meta["rows"] + ID_SPACE * (worker_index(environment) + 1)),
                 live={}, deleted={}, recent_deleted=[], last_seq=0, levels=itertools.cycle(LEVELS))


def _search_body(options: Any, vector: np.ndarray, level: str | None, seq: int | None = None) -> bytes:
    body: dict[str, Any] = {"vectors_b64": b64_rows(vector[None, :]), "k": options.k, "engine": options.engine}
    if level:
        body["consistency"] = level
        if level == "session":
            body["seq"] = seq if seq is not None else STATE["last_seq"]
    return orjson.dumps(body)


class SearchUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def search(self) -> None:
        options = self.environment.parsed_options
        data: Dataset = STATE["data"]
        recent = STATE["recent_deleted"]
        if recent and random.random() < 0.5:
            vector = random.choice(recent)[1]
        else:
            vector = data.queries[random.randrange(len(data.queries))]
        level = options.consistency or "bounded"
        session_seq = STATE["last_seq"]
        sent_at = time.monotonic()
        with self.client.post(f"/v1/collections/{options.collection}/search", name="search", catch_response=True,
                              data=_search_body(options, vector, options.consistency or None, session_seq),
                              headers={"Content-Type": "application/json", **auth_headers(self.environment)}) as r:
            if r.status_code != 200:
                fail(r, "POST search")
                return
            ids = orjson.loads(r.content)["ids"][0]
            stale = [i for i in ids if i in STATE["deleted"] and STATE["deleted"][i][0] <= sent_at]
            TALLY.add("background_searches")
            if stale:
                broken = [i for i in stale
                          if promised_gone(level, *STATE["deleted"][i], sent_at, session_seq, options.bound_ms / 1000)]
                TALLY.add(f"deleted_returned:{level}")
                TALLY.add(f"deleted_returned_broken:{level}", int(bool(broken)))
                if broken:  # within the level's bound it is no failure: read_your_writes() reports it apart
                    r.failure(f"deleted id {broken[0]} returned (consistency {level}, which promised it gone)")


class WriterUser(FastHttpUser):
    fixed_count = 1  # one writer per load-generator process, at a fixed rate

    def wait_time(self) -> float:
        rate = self.environment.parsed_options.write_rate
        self._due = max(getattr(self, "_due", time.monotonic()) + 1 / rate, time.monotonic() - 1)
        return max(0.0, self._due - time.monotonic())

    def _post(self, path: str, body: bytes, name: str) -> Any:
        # Connection: close, so that each request may land on any worker process of the service
        headers = {"Content-Type": "application/json", "Connection": "close", **auth_headers(self.environment)}
        return self.client.request("PUT" if path.endswith("/points") else "POST", path, data=body, name=name,
                                   headers=headers, catch_response=True)

    @task
    def write(self) -> None:
        if len(STATE["live"]) > 4 * self.environment.parsed_options.write_batch and random.random() < 0.5:
            self._delete()
        else:
            self._upsert()

    def _upsert(self) -> None:
        options = self.environment.parsed_options
        ids = [next(STATE["next_id"]) for _ in range(options.write_batch)]
        vectors = STATE["rng"].standard_normal((len(ids), STATE["data"].queries.shape[1])).astype(np.float32)
        body = orjson.dumps({"ids": ids, "vectors_b64": b64_rows(vectors)})
        with self._post(f"/v1/collections/{options.collection}/points", body, "upsert") as r:
            if r.status_code != 200:
                fail(r, "PUT upsert")
                return
            seq = orjson.loads(r.content)["seq"]
        STATE["last_seq"] = max(STATE["last_seq"], seq)
        STATE["live"].update(zip(ids, vectors))
        probe = random.randrange(len(ids))
        self._probe("upsert", ids[probe], vectors[probe], seq)

    def _delete(self) -> None:
        options = self.environment.parsed_options
        victims = random.sample(sorted(STATE["live"]), k=max(1, options.write_batch // 2))
        with self._post(f"/v1/collections/{options.collection}/points/delete", orjson.dumps({"ids": victims}),
                        "delete") as r:
            if r.status_code != 200:
                fail(r, "POST delete")
                return
            seq = orjson.loads(r.content)["seq"]
        acked_at = time.monotonic()
        STATE["last_seq"] = max(STATE["last_seq"], seq)
        vectors = [STATE["live"].pop(i) for i in victims]
        for i, v in zip(victims, vectors):
            STATE["deleted"][i] = (acked_at, seq)
            STATE["recent_deleted"].append((i, v))
        del STATE["recent_deleted"][:-200]
        self._probe("delete", victims[0], vectors[0], seq)

    def _probe(self, kind: str, point_id: int, vector: np.ndarray, seq: int) -> None:
        options = self.environment.parsed_options
        level = next(STATE["levels"])
        sent_at = time.monotonic()
        with self._post(f"/v1/collections/{options.collection}/search", _search_body(options, vector, level, seq),
                        f"probe {level}") as r:
            if r.status_code != 200:
                fail(r, f"POST probe {level}")
                return
            ids = orjson.loads(r.content)["ids"][0]
            if kind == "delete" and point_id in ids:
                acked_at, _ = STATE["deleted"][point_id]
                broken = promised_gone(level, acked_at, seq, sent_at, seq, options.bound_ms / 1000)
                TALLY.add(f"deleted_returned_broken:{level}", int(broken))
                if broken:  # else within the level's bound: counted apart, no failure
                    r.failure(f"deleted id {point_id} returned right after its delete (consistency {level}, "
                              "which promised it gone)")
        ok = (point_id in ids) if kind == "upsert" else (point_id not in ids)
        TALLY.add(f"ryw:{kind}:{level}:probes")
        TALLY.add(f"ryw:{kind}:{level}:ok", int(ok))
        fire_figure(self.environment, "RYW", f"{'upsert found' if kind == 'upsert' else 'delete gone'} {level}",
                    1.0 if ok else 0.0)
