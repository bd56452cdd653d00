"""SSB load: the 13 SSB queries with random valid template parameters (loadtests/ssb_params.py), and ad-hoc SQL
(`--sql-share` of the requests), on the dataset the engines hold, through switchyard_client's ssb_query() and
sql(). Each query is its own statistic ("ssb Q2.1"). The answers are taken as sent (`output="json"`): a table
built from each (the client's default, pyarrow) would cost the load generator, not the service.

    locust -f loadtests/locustfiles/olap_queries.py --headless -u 4 -t 30s --host http://127.0.0.1:8000 --engine cpu
"""

from __future__ import annotations

import random
from typing import Any, Callable

from locust import events, task

from loadtests.locustfiles.common import TALLY, SwitchyardUser
from loadtests.ssb_params import GENERATORS, random_params, random_sql


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("olap")
    group.add_argument("--engine", default="auto", help="auto | gpu | cpu | postgres | cudf | duckdb")
    group.add_argument("--queries", default=",".join(GENERATORS), help="SSB query ids to mix (default all 13)")
    group.add_argument("--sql-share", type=float, default=0.2, help="share of requests that are ad-hoc SQL")
    group.add_argument("--seed", type=int, default=0)


class OlapUser(SwitchyardUser):
    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.random = random.Random(f"{options.seed}:{id(self)}")
        self.queries = [q.strip() for q in options.queries.split(",") if q.strip()]

    def _query(self, name: str, call: Callable[..., Any], *args: Any) -> None:
        with self.request("POST", name) as request:
            answer = request.run(call, *args, engine=self.environment.parsed_options.engine, output="json")
            TALLY.add(f"engine:{answer['engine']}")
            if answer.get("fallback"):
                TALLY.add(f"fallback:{answer['engine']}")

    @task
    def query(self) -> None:
        options = self.environment.parsed_options
        if self.random.random() < options.sql_share:
            name, sql = random_sql(self.random)
            self._query(f"sql {name}", self.client.sql, sql)
            return
        query_id = self.random.choice(self.queries)
        self._query(f"ssb Q{query_id}", self.client.ssb_query, query_id, random_params(query_id, self.random))
