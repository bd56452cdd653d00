"""What every Switchyard Locust file shares: the user that calls the service through switchyard_client, custom
statistics, exact tallies merged on the master, recall.

`SwitchyardUser` holds one `switchyard_client.Client` per user, the client users install, over its http.client
transport: Locust monkey-patches the standard library's sockets with gevent, so users wait for the service
without blocking one another (libcurl, the client's default transport, does its own I/O and would block the whole
process while it waits). Retries are off: a load generator counts refusals, it never hides them by sending the
request again. Each call is reported as Locust's own users report a request (`SwitchyardUser.request`).

Locust has one kind of statistic, the request. A figure that is not a latency (recall@k, read-your-writes) is
recorded as a synthetic request whose "response time" is the figure in percent, so it shows in the web UI, the
CSVs and the HTML report beside the latencies: its Average column is the mean. Locust rounds the histogram behind
the percentiles, never the sum behind the mean. A figure goes into its own row only, never into Locust's total
(the "Aggregated" row, and the HTML report's charts): those stay the real requests'. The exact counts behind
each figure are also kept in a `Tally` that workers send to the master with their stats reports and that the
master (or a local run) writes as JSON, with the refusals (429, 503) of each request apart from its failures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, ParamSpec, TypeVar

import numpy as np
from locust import User, constant, events
from locust.exception import CatchResponseError, LocustError

from loadtests.sweep import latency_bucket
from switchyard_client import Client, RetryPolicy, SwitchyardError, TransportError

P = ParamSpec("P")
T = TypeVar("T")

PERCENT = 100.0
FIGURES = {"RECALL", "RYW"}  # request types that carry a figure, not a latency


REFUSED = (429, 503)  # answers that say the request was not run: come back later
CLIENT_ERRORS = (SwitchyardError, TransportError)  # a call's failures: an error answer, a connection that failed
NO_RETRIES = RetryPolicy(max_retries=0)


def fire_figure(environment: Any, kind: str, name: str, value: float) -> None:
    """Record `value` (0..1) as a synthetic request `kind name` with response time value x 100, in that entry of
    Locust's statistics only: not through events.request, which would also add it to the total (the Aggregated
    row, and the RPS and response-time charts of the HTML report) as if it were a request."""
    environment.stats.get(name, kind).log(value * PERCENT, 0)


def tally_refusal(error: BaseException, request: str) -> None:
    """`request` ("POST search") failed with `error`: a refusal (an error answer 429 or 503, raised by the client
    as QuotaExceeded, Overloaded, Unavailable or DeadlineExceeded) is tallied as `refused:<request>`, so that the
    report shows it beside the other failures."""
    if isinstance(error, SwitchyardError) and error.status in REFUSED:
        TALLY.add(f"refused:{request}")


class Tally:
    """Exact integer counters by name, summed over users, processes and workers.

    A worker sends what it counted since its last report (report_to_master) and the master adds it up
    (worker_report); a local run keeps everything itself. `write` saves the totals as JSON."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # users are greenlets, but the master merges from its own greenlet too
        self._since_report: dict[str, int] = defaultdict(int)
        self._merged: dict[str, int] = defaultdict(int)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._since_report[name] += amount

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._since_report = dict(self._since_report), defaultdict(int)
        return out

    def merge(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, amount in counts.items():
                self._merged[name] += amount

    def totals(self) -> dict[str, int]:
        with self._lock:
            out = defaultdict(int, self._merged)
            for name, amount in self._since_report.items():
                out[name] += amount
        return dict(sorted(out.items()))

    def write(self, path: str | None) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(self.totals(), indent=1))


TALLY = Tally()


@events.init_command_line_parser.add_listener
def _common_options(parser: Any) -> None:
    group = parser.add_argument_group("switchyard")
    group.add_argument("--tally-out", default="", help="write the exact counters behind the custom figures here (JSON)")
    group.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY", ""),
                       help="bearer token, if the service wants one")
    group.add_argument("--responses-out", default="",
                       help="append every answer's ids here (JSON lines), for offline checks")


@events.report_to_master.add_listener
def _send_tally(client_id: str, data: dict) -> None:
    data["switchyard_tally"] = TALLY.take()


@events.worker_report.add_listener
def _merge_tally(client_id: str, data: dict) -> None:
    TALLY.merge(data.get("switchyard_tally", {}))


def _is_worker(environment: Any) -> bool:
    return type(environment.runner).__name__ == "WorkerRunner"


@events.test_stop.add_listener
def _final_csv_rows(environment: Any, **_: Any) -> None:
    # Locust rewrites its CSVs once a second and not again at exit: give its writer one more turn now that the
    # users have stopped, so the CSVs hold the final figures (the same as final_stats.json below).
    import gevent
    from locust import stats

    if not _is_worker(environment):
        gevent.sleep(stats.CSV_STATS_INTERVAL_SEC + 0.2)


@events.quit.add_listener
def _write_final(exit_code: int, **_: Any) -> None:
    environment = STATE_ENV.get("environment")
    if environment is None or _is_worker(environment):
        return
    options = environment.parsed_options
    TALLY.write(options.tally_out)
    if options.tally_out:
        Path(options.tally_out).with_name("final_stats.json").write_text(json.dumps(final_stats(environment), indent=1))


STATE_ENV: dict[str, Any] = {}


@events.init.add_listener
def _remember_environment(environment: Any, **_: Any) -> None:
    STATE_ENV["environment"] = environment


def final_stats(environment: Any) -> dict[str, dict[str, Any]]:
    """Every request entry's final figures, as {"TYPE name": {...}}: the exact sum behind the mean included."""
    out = {}
    for entry in environment.stats.entries.values():
        out[f"{entry.method} {entry.name}"] = {
            "count": entry.num_requests, "failures": entry.num_failures, "avg": entry.avg_response_time,
            "total": entry.total_response_time, "median": entry.median_response_time,
            "p99": entry.get_response_time_percentile(0.99) if entry.num_requests else None,
            "rps": entry.total_rps}
    return out


@events.request.add_listener
def _record_latency(request_type: str, name: str, response_time: float, exception: Any = None, **_: Any) -> None:
    """Latencies in log buckets 1% wide, in the tally: exact enough for sub-millisecond percentiles, which
    Locust's own histogram rounds to whole milliseconds."""
    if request_type in FIGURES or exception is not None or response_time is None:
        return
    TALLY.add(f"latency:{request_type} {name}:{latency_bucket(response_time)}")


class MeteredClient(Client):
    """switchyard_client.Client adding up the bytes of the answers it received: Locust's response length (the
    client gives its callers arrays, not bodies). It hooks Client._send, which every request of every call
    passes through."""

    received = 0

    def __enter__(self) -> "MeteredClient":
        return self

    def _send(self, request: Any) -> Any:
        response = super()._send(request)
        self.received += len(response.body)
        return response


def connect(environment: Any, host: str) -> MeteredClient:
    """A client of the service under test, as a load generator holds one: http.client (gevent-friendly: never
    pycurl), no retries, the --api-key. No timeout: no deadline is sent, as before the client."""
    return MeteredClient(host, api_key=environment.parsed_options.api_key or None, retry=NO_RETRIES,
                         transport="http")


class Call:
    """One client call reported as one Locust request, as Locust's own users report theirs:

        with self.request("POST", "search") as call:
            hits = call.run(self.client.search, collection, vector, k=10)
            ...  # read the answer; call.failure("why") makes the request a failure

    `run` is what is timed (time.perf_counter around the client call alone, not the checks after it); the
    request is reported when the block ends. A client error raised by `run` (an error answer, a connection that
    failed) ends the block and is the request's failure (a refusal is also tallied: tally_refusal); any other
    exception is reported as its failure too, and raised on."""

    def __init__(self, user: "SwitchyardUser", request_type: str, name: str, client: MeteredClient) -> None:
        self.user, self.request_type, self.name, self.client = user, request_type, name, client
        self.response_time = 0.0
        self.response_length = 0
        self.exception: BaseException | None = None
        self.start_time = time.time()

    @property
    def failed(self) -> bool:
        return self.exception is not None

    def run(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        received = self.client.received
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.response_time = (time.perf_counter() - started) * 1000
            self.response_length = self.client.received - received

    def failure(self, message: str) -> None:
        """The answer came, but it is wrong: a failure with this message."""
        self.exception = CatchResponseError(message)

    def __enter__(self) -> "Call":
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # the user is being stopped (GreenletExit) mid-call: no outcome to report
        if error is not None:
            self.exception = error
            tally_refusal(error, f"{self.request_type} {self.name}")
        self.user.environment.events.request.fire(
            request_type=self.request_type, name=self.name, response_time=self.response_time,
            response_length=self.response_length, exception=self.exception, context=self.user.context(),
            start_time=self.start_time)
        return isinstance(error, CLIENT_ERRORS)


class SwitchyardUser(User):
    """A Locust user calling Switchyard through one switchyard_client.Client of its own (`self.client`, see
    `connect`): closed loop by default."""

    abstract = True
    wait_time = constant(0)

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        if not self.host:
            raise LocustError("give the service's URL with --host (http://host:port, or unix:/path/to.sock)")
        self.client = self.connect()

    def connect(self) -> MeteredClient:
        """A new client (and so a new connection) of this user's."""
        return connect(self.environment, str(self.host))

    def on_stop(self) -> None:
        self.client.close()

    def request(self, request_type: str, name: str, client: MeteredClient | None = None) -> Call:
        """A call to report as the request `request_type name` ("POST search"), made with `client` (this user's
        by default): see Call."""
        return Call(self, request_type, name, client or self.client)


def id_lists(ids: np.ndarray) -> list[list[int]]:
    """A search's ids as one list per query, as the service sent them: a 1-D answer is one query; the padding
    the client adds to a batch's short rows (id -1) is left out."""
    if ids.ndim == 1:
        return [ids.tolist()]
    return [[i for i in row if i >= 0] for row in ids.tolist()]


def worker_index(environment: Any) -> int:
    """This process's index among Locust workers (0 in a local run): keeps id ranges and query orders apart."""
    return int(getattr(environment.runner, "worker_index", 0) or 0)


class ResponseLog:
    """Every answer's ids as JSON lines ({"query": row, "ids": [...]}), when --responses-out names a file."""

    def __init__(self) -> None:
        self.file = None

    def open(self, path: str, worker: int | None) -> None:
        if path and worker is not None:  # one file per worker process: appends from several would interleave
            path = f"{path}.worker{worker}"
        self.file = open(path, "a") if path else None

    def write(self, row: int, ids: list[int]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"query": row, "ids": ids}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


RESPONSES = ResponseLog()


@events.test_start.add_listener
def _open_responses(environment: Any, **_: Any) -> None:
    RESPONSES.open(environment.parsed_options.responses_out,
                   worker_index(environment) if _is_worker(environment) else None)


@events.test_stop.add_listener
def _close_responses(environment: Any, **_: Any) -> None:
    RESPONSES.close()


def score(environment: Any, data: "Dataset", rows: list[int], answers: list[list[int]], k: int) -> None:
    """recall@k of each answer: a RECALL statistic, exact counts in the tally, the ids in the response log."""
    for row, got in zip(rows, answers):
        hits = data.hits(row, got, k)
        TALLY.add("recall_hits", hits)
        TALLY.add("recall_queries")
        fire_figure(environment, "RECALL", f"recall@{k}", hits / k)
        RESPONSES.write(row, got)


class Dataset:
    """Queries and their exact neighbours, written by the runner (loadtests/datasets.py) into one folder."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.meta = json.loads((folder / "meta.json").read_text())
        self.queries = np.load(folder / "queries.npy").astype(np.float32)
        self.neighbors = np.load(folder / "neighbors.npy").astype(np.int64)

    def hits(self, query: int, ids: list[int], k: int) -> int:
        """How many of `ids` are among the query's k exact nearest neighbours (VectorDBBench's recall@k)."""
        truth = self.neighbors[query, :k]
        return int(np.isin(np.asarray(ids[:k], dtype=np.int64), truth).sum())
