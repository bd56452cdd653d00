"""Geometry join load: point-in-polygon counts, point-in-polygon pairs (paged with next_cursor) and
within-distance pairs, on layers that `switchyard loadtest spatial` creates (or your own). Each kind of join is
a task; `--tasks` picks them, `--max-pages` bounds how many pages one paged join reads (each page is a request).

    locust -f loadtests/locustfiles/spatial_joins.py --headless -u 4 -t 30s --host http://127.0.0.1:8000 \\
        --points-layer lt_points --polygons-layer lt_polygons --distance-layer lt_near --radius-m 200
"""

from __future__ import annotations

from typing import Any

import orjson
from locust import FastHttpUser, constant, events, task

from loadtests.locustfiles.common import TALLY, auth_headers, fail

TASKS = ("pip-counts", "pip-pairs", "distance")


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("spatial joins")
    group.add_argument("--points-layer", default="lt_points")
    group.add_argument("--polygons-layer", default="lt_polygons")
    group.add_argument("--distance-layer", default="lt_near", help="points layer of the within-distance self-join")
    group.add_argument("--radius-m", type=float, default=200)
    group.add_argument("--engine", default="auto", help="auto | gpu | cpu | postgis")
    group.add_argument("--page-size", type=int, default=10_000)
    group.add_argument("--max-pages", type=int, default=3, help="pages read per paged join")
    group.add_argument("--tasks", default=",".join(TASKS), help="which joins: " + ", ".join(TASKS))


class SpatialUser(FastHttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        chosen = [t.strip() for t in self.environment.parsed_options.tasks.split(",") if t.strip()]
        unknown = set(chosen) - set(TASKS)
        if unknown or not chosen:
            raise SystemExit(f"--tasks: unknown {sorted(unknown)}; choose among {', '.join(TASKS)}")
        self.tasks = [getattr(SpatialUser, t.replace("-", "_")) for t in chosen]

    def _join(self, path: str, body: dict[str, Any], name: str, pages: int) -> None:
        headers = {"Content-Type": "application/json", **auth_headers(self.environment)}
        for _page in range(pages):
            with self.client.post(path, data=orjson.dumps(body), name=name, headers=headers,
                                  catch_response=True) as r:
                if r.status_code != 200:
                    fail(r, f"POST {name}")
                    return
                answer = orjson.loads(r.content)
            TALLY.add(f"pairs:{name}", len(answer.get("pairs", [])))
            TALLY.add(f"engine:{name}:{answer['engine']}")
            cursor = answer.get("next_cursor")
            if not cursor:
                return
            body = {**body, "cursor": cursor}

    @task
    def pip_counts(self) -> None:
        o = self.environment.parsed_options
        self._join("/v1/spatial/joins/point-in-polygon", {"points": o.points_layer, "polygons": o.polygons_layer,
                                                           "mode": "counts", "engine": o.engine}, "pip counts", 1)

    @task
    def pip_pairs(self) -> None:
        o = self.environment.parsed_options
        self._join("/v1/spatial/joins/point-in-polygon", {"points": o.points_layer, "polygons": o.polygons_layer,
                                                           "mode": "pairs", "engine": o.engine,
                                                           "page_size": o.page_size}, "pip pairs page", o.max_pages)

    @task
    def distance(self) -> None:
        o = self.environment.parsed_options
        self._join("/v1/spatial/joins/within-distance", {"left": o.distance_layer, "right": o.distance_layer,
                                                          "radius_m": o.radius_m, "engine": o.engine,
                                                          "page_size": o.page_size}, "distance page", o.max_pages)
