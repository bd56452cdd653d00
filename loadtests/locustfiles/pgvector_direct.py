"""The baseline users run without Switchyard: the same queries as search_vectors.py, sent as SQL to a plain
PostgreSQL + pgvector server (HNSW), the way an application would run pgvector itself.

One psycopg 3 connection per user (psycopg cooperates with gevent from 3.1.14 on, so users do not block each
other), binary parameters, a prepared statement, `hnsw.ef_search` set per run. Ids are checked against the same
ground truth and recall@k is recorded as in search_vectors.py. The runner (`--baseline pgvector-direct URL`)
loads the table and builds the index; by hand:

    locust -f loadtests/locustfiles/pgvector_direct.py --headless -u 16 -t 30s \\
        --pg-dsn postgresql://postgres@localhost/postgres --pg-table loadtest --dataset out/dataset --ef-search 40
"""

from __future__ import annotations

import time
from typing import Any

from locust import User, constant, events, task

from loadtests.locustfiles.common import Dataset, score

STATE: dict[str, Any] = {}
OPERATORS = {"l2": "<->", "cosine": "<=>", "inner_product": "<#>"}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("pgvector direct")
    group.add_argument("--pg-dsn", default="", help="libpq URL of the PostgreSQL + pgvector server")
    group.add_argument("--pg-table", default="loadtest", help="table with columns id bigint, embedding vector")
    group.add_argument("--dataset", default="", help="folder with queries.npy, neighbors.npy, meta.json")
    group.add_argument("--ef-search", type=int, default=40, help="hnsw.ef_search (pgvector's default is 40)")
    group.add_argument("--k", type=int, default=10)
    group.add_argument("--batch", type=int, default=1, help="queries per request, sent in one pipeline")


@events.test_start.add_listener
def _load(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options.dataset:
        STATE["data"] = Dataset(options.dataset)
        STATE["next"] = 0


class PgvectorDirectUser(User):
    wait_time = constant(0)

    def on_start(self) -> None:
        import psycopg
        from pgvector.psycopg import register_vector

        options = self.environment.parsed_options
        self.conn = psycopg.connect(options.pg_dsn, autocommit=True)
        register_vector(self.conn)
        self.conn.execute(f"SET hnsw.ef_search = {int(options.ef_search)}")
        metric = STATE["data"].meta.get("metric", "l2")
        self.sql = f"SELECT id FROM {options.pg_table} ORDER BY embedding {OPERATORS[metric]} %s LIMIT %s"

    def on_stop(self) -> None:
        self.conn.close()

    @task
    def search(self) -> None:
        options = self.environment.parsed_options
        data: Dataset = STATE["data"]
        start = STATE["next"] % (len(data.queries) - options.batch + 1)
        STATE["next"] += options.batch
        rows = list(range(start, start + options.batch))
        began, answers, error = time.perf_counter(), [], None
        try:
            if len(rows) == 1:  # a pipeline would only add a sync round
                cursors = [self.conn.execute(self.sql, (data.queries[start], options.k), prepare=True, binary=True)]
            else:
                with self.conn.pipeline():
                    cursors = [self.conn.execute(self.sql, (data.queries[row], options.k), prepare=True, binary=True)
                               for row in rows]
            answers = [[r[0] for r in cur.fetchall()] for cur in cursors]
        except Exception as exc:  # noqa: BLE001 - every driver error is a failed request, reported as such
            error = exc
        elapsed_ms = (time.perf_counter() - began) * 1000
        name = "search" if options.batch == 1 else f"search batch={options.batch}"
        self.environment.events.request.fire(request_type="SQL", name=name, response_time=elapsed_ms,
                                             response_length=0, response=None, context={}, exception=error)
        score(self.environment, data, rows, answers, options.k)
