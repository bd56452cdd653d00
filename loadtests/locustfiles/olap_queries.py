"""SSB load: the 13 SSB queries with random valid template parameters (loadtests/ssb_params.py), and ad-hoc SQL
(`--sql-share` of the requests), on the dataset the engines hold. Each query is its own statistic ("ssb Q2.1").

    locust -f loadtests/locustfiles/olap_queries.py --headless -u 4 -t 30s --host http://127.0.0.1:8000 --engine cpu
"""

from __future__ import annotations

import random
from typing import Any

import orjson
from locust import FastHttpUser, constant, events, task

from loadtests.locustfiles.common import TALLY, auth_headers, fail
from loadtests.ssb_params import GENERATORS, random_params, random_sql


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("olap")
    group.add_argument("--engine", default="auto", help="auto | gpu | cpu | postgres | cudf | duckdb")
    group.add_argument("--queries", default=",".join(GENERATORS), help="SSB query ids to mix (default all 13)")
    group.add_argument("--sql-share", type=float, default=0.2, help="share of requests that are ad-hoc SQL")
    group.add_argument("--seed", type=int, default=0)


class OlapUser(FastHttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.random = random.Random(f"{options.seed}:{id(self)}")
        self.queries = [q.strip() for q in options.queries.split(",") if q.strip()]

    def _post(self, path: str, body: dict[str, Any], name: str) -> None:
        headers = {"Content-Type": "application/json", **auth_headers(self.environment)}
        with self.client.post(path, data=orjson.dumps(body), name=name, headers=headers, catch_response=True) as r:
            if r.status_code != 200:
                fail(r, f"POST {name}")
                return
            answer = orjson.loads(r.content)
        TALLY.add(f"engine:{answer['engine']}")
        if answer.get("fallback"):
            TALLY.add(f"fallback:{answer['engine']}")

    @task
    def query(self) -> None:
        options = self.environment.parsed_options
        if self.random.random() < options.sql_share:
            name, sql = random_sql(self.random)
            self._post("/v1/olap/sql", {"sql": sql, "engine": options.engine}, f"sql {name}")
            return
        query_id = self.random.choice(self.queries)
        self._post(f"/v1/olap/ssb/queries/{query_id}", {"engine": options.engine,
                                                        "params": random_params(query_id, self.random)},
                   f"ssb Q{query_id}")
