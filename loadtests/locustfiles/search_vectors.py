"""Vector search load: closed-loop users send single-vector or batch searches through switchyard_client and check
every answer's ids against exact ground truth; recall@k is its own statistic (request type RECALL, "response
time" = recall in %).

    locust -f loadtests/locustfiles/search_vectors.py --headless -u 16 -t 30s --host http://127.0.0.1:8000 \\
        --collection bench --dataset out/dataset --engine cpu --params '{"ef": 64}'

The queries travel as the client sends them, raw float32: one vector per request (`--batch 1`, the service's
micro-batched path), or a matrix of `--batch` rows. Works distributed: every worker needs the dataset folder at
the same path; the recall tallies are summed on the master. `switchyard loadtest vectors` prepares the collection
and the dataset and sweeps engines, parameters and users.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
from locust import events, task

from loadtests.locustfiles.common import TALLY, Dataset, SwitchyardUser, id_lists, score, worker_index

STATE: dict[str, Any] = {}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("vector search")
    group.add_argument("--collection", default="loadtest", help="collection to search")
    group.add_argument("--dataset", default="", help="folder with queries.npy, neighbors.npy, meta.json")
    group.add_argument("--engine", default="auto", help="auto | cpu | gpu | pgvector")
    group.add_argument("--params", default="", help='search parameters as JSON, e.g. {"ef": 64}')
    group.add_argument("--k", type=int, default=10)
    group.add_argument("--batch", type=int, default=1, help="queries per request (1: single-vector searches)")
    group.add_argument("--consistency", default="",
                       help="strong | session | bounded | eventually (default: the service's)")


@events.test_start.add_listener
def _load(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if not options.dataset:
        raise SystemExit("--dataset is required: a folder with queries.npy, neighbors.npy and meta.json")
    data = Dataset(options.dataset)
    STATE.update(data=data, batches=_batches(data, options.batch), search=_search_options(options),
                 counter=itertools.count(worker_index(environment) * 7919))


def _batches(data: Dataset, batch: int) -> list[tuple[list[int], np.ndarray]]:
    """Every request's rows and queries, cut once (little-endian float32, as the client sends them, so it copies
    nothing more): one vector for single searches, else a matrix of `batch` rows."""
    queries = np.ascontiguousarray(data.queries, dtype="<f4")
    n, b = len(queries), max(1, batch)
    return [(list(range(start, start + b)), queries[start] if b == 1 else queries[start:start + b])
            for start in range(0, n - b + 1, b)]


def _search_options(options: Any) -> dict[str, Any]:
    """The client's search arguments besides the collection and the vectors. No --consistency: none is sent
    (the service's default; this client never writes, so it has no read-your-writes session either)."""
    return {"k": options.k, "engine": options.engine, "params": json.loads(options.params) if options.params else None,
            "consistency": options.consistency or None}


class VectorSearchUser(SwitchyardUser):
    @task
    def search(self) -> None:
        options = self.environment.parsed_options
        batches = STATE["batches"]
        rows, queries = batches[next(STATE["counter"]) % len(batches)]
        name = "search" if options.batch == 1 else f"search batch={options.batch}"
        with self.request("POST", name) as call:
            hits = call.run(self.client.search, options.collection, queries, **STATE["search"])
            TALLY.add(f"engine:{hits.engine}")  # what answered: faiss, cuvs, pgvector
            if hits.fallback:
                TALLY.add(f"fallback:{hits.engine}")
            score(self.environment, STATE["data"], rows, id_lists(hits.ids), options.k)
