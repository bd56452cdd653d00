"""The open-loop generator (loadtests/openloop.py) against a server of known behaviour: it sends its schedule on
time from its own processes, counts latency from each request's due time, and tells answers from refusals."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtests import openloop

pytestmark = pytest.mark.timeout(120)
DELAY_S = 0.02  # how long the server takes over each /slow request
SERIAL = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the generator expects
    disable_nagle_algorithm = True  # the head and the body go in two writes: no 40 ms delayed ACK between

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/slow":
            time.sleep(DELAY_S)
        if self.path == "/serial":  # one at a time: 50 answers a second at most
            with SERIAL:
                time.sleep(DELAY_S)
        refused = self.path == "/refused"
        body = b'{"type": "urn:switchyard:problem:overloaded"}' if refused else b"{}"
        self.send_response(503 if refused else 200)
        if refused:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_the_schedule_is_sent_on_time_and_latency_counts_from_each_due_time(port):
    requests = [openloop.http_request("POST", "/slow", b"{}", "slow"),
                openloop.http_request("POST", "/", b"{}", "fast")]
    rate, duration = 200.0, 2.0
    r = openloop.run(port, requests, duration, rate=rate, processes=2)
    assert r["sent"] == rate * duration and r["errors"] == {} and r["shed_share"] == 0
    assert r["admitted_per_s"] == pytest.approx(rate, rel=0.02)  # (the last answer came one latency after the end)
    assert r["generator"]["late_p99_ms"] < 50  # every process had started before the schedule began
    slow, fast = r["by_label"]["slow"], r["by_label"]["fast"]
    assert slow["admitted"] == fast["admitted"] == rate * duration / 2
    assert slow["p50_ms"] >= 1000 * DELAY_S > fast["p50_ms"]
    assert [s["second"] for s in r["by_second"]] == [0, 1] and sum(s["answered"] for s in r["by_second"]) == 400


def test_refusals_are_counted_apart_with_their_retry_after(port):
    requests = [openloop.http_request("POST", "/refused", b"{}", "x"), openloop.http_request("POST", "/", b"{}", "x")]
    r = openloop.run(port, requests, 1.0, rate=100.0, processes=1)
    assert r["sent"] == 100 and r["shed_share"] == 0.5 and r["shed_without_retry_after"] == 0
    assert r["admitted_per_s"] == pytest.approx(50, rel=0.02)


def test_answers_made_after_the_schedule_ended_count_over_the_time_they_took(port):
    """A server that answers 50 a second, offered 100 a second for a second: 100 answers over about two seconds."""
    r = openloop.run(port, [openloop.http_request("POST", "/serial", b"{}", "x")], 1.0, rate=100.0, processes=1)
    assert r["sent"] == 100 and r["errors"] == {} and r["shed_share"] == 0
    assert r["seconds"] >= 1.8 and 45 <= r["admitted_per_s"] <= 56
