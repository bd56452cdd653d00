"""Geometry join load: point-in-polygon counts, point-in-polygon pairs and within-distance pairs, through
switchyard_client, on layers that `switchyard loadtest spatial` creates (or your own). Each kind of join is a
task; `--tasks` picks them. A paged join is read a page per request (the client's `max_pages=1`, and its
`next_cursor` for the next), `--max-pages` pages at most.

    locust -f loadtests/locustfiles/spatial_joins.py --headless -u 4 -t 30s --host http://127.0.0.1:8000 \\
        --points-layer lt_points --polygons-layer lt_polygons --distance-layer lt_near --radius-m 200
"""

from __future__ import annotations

from typing import Any, Callable

from locust import events, task

from loadtests.locustfiles.common import TALLY, SwitchyardUser

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


class SpatialUser(SwitchyardUser):
    def on_start(self) -> None:
        chosen = [t.strip() for t in self.environment.parsed_options.tasks.split(",") if t.strip()]
        unknown = set(chosen) - set(TASKS)
        if unknown or not chosen:
            raise SystemExit(f"--tasks: unknown {sorted(unknown)}; choose among {', '.join(TASKS)}")
        self.tasks = [getattr(SpatialUser, t.replace("-", "_")) for t in chosen]

    @staticmethod
    def _tally(name: str, pairs: int, engine: str) -> None:
        TALLY.add(f"pairs:{name}", pairs)
        TALLY.add(f"engine:{name}:{engine}")

    def _pages(self, name: str, join: Callable[..., Any], *args: Any) -> None:
        """A paged join, a page per request, --max-pages of them at most."""
        o = self.environment.parsed_options
        cursor = None
        for _page in range(o.max_pages):
            with self.request("POST", name) as call:
                page = call.run(join, *args, engine=o.engine, page_size=o.page_size, cursor=cursor, max_pages=1)
                self._tally(name, len(page.left), page.engine)
                cursor = page.next_cursor
            if call.failed or not cursor:
                return

    @task
    def pip_counts(self) -> None:
        o = self.environment.parsed_options
        with self.request("POST", "pip counts") as call:
            counts = call.run(self.client.point_in_polygon_counts, o.points_layer, o.polygons_layer, engine=o.engine)
            self._tally("pip counts", 0, counts.engine)

    @task
    def pip_pairs(self) -> None:
        o = self.environment.parsed_options
        self._pages("pip pairs page", self.client.point_in_polygon, o.points_layer, o.polygons_layer)

    @task
    def distance(self) -> None:
        o = self.environment.parsed_options
        self._pages("distance page", self.client.within_distance, o.distance_layer, o.distance_layer, o.radius_m)
