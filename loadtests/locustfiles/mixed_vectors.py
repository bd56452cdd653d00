"""Searches while upserts and deletes stream in at a fixed rate (VectorDBBench's streaming case), and
read-your-writes measured from real answers.

Every request goes through switchyard_client (common.py); a search sends its vector as a batch of one.

- `SearchUser`s (closed loop) search with the dataset's queries and, half the time, with the vector of a point
  deleted a moment ago, at `--consistency` (none given: none sent, the service's default). An answer holding an
  id whose delete was acknowledged before the search was sent is tallied ("deleted id returned"); it is a
  failure only where the level promised the id gone (strong, session, bounded past its bound: `promised_gone`):
  within a bounded or eventually level's bound it is what the level allows, counted apart
  (`deleted_returned:<level>` less `deleted_returned_broken:<level>`).
- One `WriterUser` per load-generator process upserts `--write-batch` new points or deletes some of them,
  `--write-rate` times a second, each through a new client (a new connection, so a multi-worker service routes
  it anywhere), and right after each acknowledgement probes one consistency level, in turn, with a search through
  another new client, naming the level (and for session the write's seq): the upserted vector must come back
  (RYW "upsert found <level>"), the deleted id must not (RYW "delete gone <level>"). Those figures are in % like
  recall; the tally holds the exact counts. A probe that returns the id just deleted is a failure where the
  level promised it gone, as above.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import numpy as np
from locust import events, task

from loadtests.locustfiles.common import TALLY, Dataset, SwitchyardUser, fire_figure, id_lists, worker_index
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


def _search(client: Any, options: Any, vector: np.ndarray, level: str | None, seq: int) -> list[int]:
    """The ids found for one vector, sent as a batch of one, at `level` (None: no level sent, the service's
    default; an explicit level wins over a client's read-your-writes session), with `seq` for session."""
    hits = client.search(options.collection, vector[None, :], k=options.k, engine=options.engine, consistency=level,
                         seq=seq if level == "session" else None)
    return id_lists(hits.ids)[0]


class SearchUser(SwitchyardUser):
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
        with self.request("POST", "search") as call:
            ids = call.run(_search, self.client, options, vector, options.consistency or None, session_seq)
            stale = [i for i in ids if i in STATE["deleted"] and STATE["deleted"][i][0] <= sent_at]
            TALLY.add("background_searches")
            if stale:
                broken = [i for i in stale
                          if promised_gone(level, *STATE["deleted"][i], sent_at, session_seq, options.bound_ms / 1000)]
                TALLY.add(f"deleted_returned:{level}")
                TALLY.add(f"deleted_returned_broken:{level}", int(bool(broken)))
                if broken:  # within the level's bound it is no failure: read_your_writes() reports it apart
                    call.failure(f"deleted id {broken[0]} returned (consistency {level}, which promised it gone)")


class WriterUser(SwitchyardUser):
    fixed_count = 1  # one writer per load-generator process, at a fixed rate

    def wait_time(self) -> float:
        rate = self.environment.parsed_options.write_rate
        self._due = max(getattr(self, "_due", time.monotonic()) + 1 / rate, time.monotonic() - 1)
        return max(0.0, self._due - time.monotonic())

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
        with self.connect() as client, self.request("PUT", "upsert", client) as call:  # a new connection
            seq = call.run(client.upsert, options.collection, ids, vectors).seq
        if call.failed:
            return
        assert seq is not None, "an acknowledged write has its seq"
        STATE["last_seq"] = max(STATE["last_seq"], seq)
        STATE["live"].update(zip(ids, vectors))
        probe = random.randrange(len(ids))
        self._probe("upsert", ids[probe], vectors[probe], seq)

    def _delete(self) -> None:
        options = self.environment.parsed_options
        victims = random.sample(sorted(STATE["live"]), k=max(1, options.write_batch // 2))
        with self.connect() as client, self.request("POST", "delete", client) as call:
            seq = call.run(client.delete, options.collection, victims).seq
        if call.failed:
            return
        assert seq is not None, "an acknowledged write has its seq"
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
        with self.connect() as client, self.request("POST", f"probe {level}", client) as call:
            ids = call.run(_search, client, options, vector, level, seq)
            if kind == "delete" and point_id in ids:
                acked_at, _ = STATE["deleted"][point_id]
                broken = promised_gone(level, acked_at, seq, sent_at, seq, options.bound_ms / 1000)
                TALLY.add(f"deleted_returned_broken:{level}", int(broken))
                if broken:  # else within the level's bound: counted apart, no failure
                    call.failure(f"deleted id {point_id} returned right after its delete (consistency {level}, "
                                 "which promised it gone)")
            ok = (point_id in ids) if kind == "upsert" else (point_id not in ids)  # a probe that was answered
            TALLY.add(f"ryw:{kind}:{level}:probes")
            TALLY.add(f"ryw:{kind}:{level}:ok", int(ok))
            fire_figure(self.environment, "RYW", f"{'upsert found' if kind == 'upsert' else 'delete gone'} {level}",
                        1.0 if ok else 0.0)
