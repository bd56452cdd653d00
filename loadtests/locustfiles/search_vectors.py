"""Vector search load: closed-loop users send single-vector or batch searches and check every answer's ids
against exact ground truth; recall@k is its own statistic (request type RECALL, "response time" = recall in %).

    locust -f loadtests/locustfiles/search_vectors.py --headless -u 16 -t 30s --host http://127.0.0.1:8000 \\
        --collection bench --dataset out/dataset --engine cpu --params '{"ef": 64}'

Works distributed: every worker needs the dataset folder at the same path; the recall tallies are summed on
the master. `switchyard loadtest vectors` prepares the collection and the dataset and sweeps engines,
parameters and users.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
from locust import FastHttpUser, constant, events, task

from loadtests.locustfiles.common import TALLY, Dataset, auth_headers, b64_rows, fail, score, worker_index

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
    group.add_argument("--encoding", choices=["json", "b64"], default="json",
                       help="single searches as {\"vector\": [...]} (json, the micro-batched path) or vectors_b64")
    group.add_argument("--consistency", default="",
                       help="strong | session | bounded | eventually (default: the service's)")


@events.test_start.add_listener
def _load(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if not options.dataset:
        raise SystemExit("--dataset is required: a folder with queries.npy, neighbors.npy and meta.json")
    data = Dataset(options.dataset)
    STATE.update(data=data, batches=_bodies(data, options), counter=itertools.count(worker_index(environment) * 7919))


def _bodies(data: Dataset, options: Any) -> list[tuple[list[int], bytes]]:
    """Every request body, encoded once: the load generator should spend its CPU on sending, not on JSON."""
    extra: dict[str, Any] = {"k": options.k, "engine": options.engine}
    if options.params:
        extra["params"] = json.loads(options.params)
    if options.consistency:
        extra["consistency"] = options.consistency
    n, b = len(data.queries), max(1, options.batch)
    out = []
    single = b == 1 and options.encoding == "json"  # how an application sends one query: JSON floats
    for start in range(0, n - b + 1, b):
        rows = list(range(start, start + b))
        query = {"vector": data.queries[start].tolist()} if single else {"vectors_b64": b64_rows(data.queries[rows])}
        out.append((rows, orjson.dumps({**query, **extra})))
    return out


class VectorSearchUser(FastHttpUser):
    wait_time = constant(0)  # closed loop: concurrency is the user count

    @task
    def search(self) -> None:
        options = self.environment.parsed_options
        batches = STATE["batches"]
        rows, body = batches[next(STATE["counter"]) % len(batches)]
        name = "search" if options.batch == 1 else f"search batch={options.batch}"
        headers = {"Content-Type": "application/json", **auth_headers(self.environment)}
        with self.client.post(f"/v1/collections/{options.collection}/search", data=body, headers=headers, name=name,
                              catch_response=True) as response:
            if response.status_code != 200:
                fail(response, f"POST {name}")
                return
            answer = orjson.loads(response.content)
            TALLY.add(f"engine:{answer['engine']}")  # what answered: faiss, cuvs, pgvector
            if answer.get("fallback"):
                TALLY.add(f"fallback:{answer['engine']}")
        ids = answer["ids"] if len(rows) > 1 or options.encoding == "b64" else [answer["ids"]]
        score(self.environment, STATE["data"], rows, ids, options.k)
