"""What a refusal costs the event loop: CPU per 503 written by the HTTP protocol for a request whose work class has
no slot and no room to wait, the kernel left out (no socket: requests are fed to the protocol's data_received).

    python loadtests/bench_refusal.py [--requests 5000] [--runs 5]

Under overload most requests are refused, and f + (4 - f) r / s <= 1 says what that leaves to answer with at 4x
(docs/design/serving.md, "Refusals cost as little as the protocol can make them"). Two kinds: a claimed search
(refused once its body is read, `Express.answer_inline`) and an SSB query (refused from its headers,
`Express.refusal`). Reported: the least CPU per refusal over the runs (uvloop, as `switchyard serve` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
import uvloop  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from service.http.app import create_app  # noqa: E402
from service.http.express_protocol import ExpressProtocol  # noqa: E402
from service.settings import Settings  # noqa: E402

SEARCH = b"/v1/collections/c128/search"
SSB = b"/v1/olap/ssb/queries/1.1"


class Sink:
    """A transport that counts writes."""

    def __init__(self) -> None:
        self.writes, self.closed = 0, False

    def write(self, data: bytes) -> None:
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5000) if name in ("peername", "sockname") else default


def request(path: bytes, dim: int = 128) -> bytes:
    body = b'{"vector": [' + b",".join(b"0.5" for _ in range(dim)) + b'], "k": 10}'
    return (b"POST " + path + b" HTTP/1.1\r\nhost: load\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def cost(path: bytes, n: int, runs: int) -> float:
    """Least CPU seconds per refusal of `path` over `runs` runs of `n` requests, every class full."""
    with tempfile.TemporaryDirectory(prefix="bench-refusal-") as data_dir:
        return await _cost(path, n, runs, data_dir)


async def _cost(path: bytes, n: int, runs: int, data_dir: str) -> float:
    app = create_app(Settings(data_dir=data_dir, max_inflight=4, inflight_latency_tolerance=0))
    loop = asyncio.get_running_loop()
    for work in app.express.admission.classes.values():  # every slot taken, every queue full
        work.inflight = work.limit
        work.waiters.extend(loop.create_future() for _ in range(2 * work.limit))
    config = uvicorn.Config(app, http=ExpressProtocol, lifespan="off", log_level="warning", access_log=False)
    config.load()
    protocol = ExpressProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    sink = Sink()
    protocol.connection_made(sink)  # type: ignore[arg-type]
    raw, best = request(path), float("inf")
    for _ in range(runs):
        started = time.process_time()
        for _ in range(n):
            protocol.data_received(raw)
        best = min(best, (time.process_time() - started) / n)
    if sink.writes != n * runs or protocol.cycle is not None:
        raise SystemExit(f"expected {n * runs} refusals written by the protocol, got {sink.writes}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for name, path in (("search (claimed, refused once its body is read)", SEARCH),
                       ("SSB query (refused from its headers)", SSB)):
        seconds = uvloop.run(cost(path, args.requests, args.runs))
        print(f"{name}: {seconds * 1e6:.1f} us of CPU per refusal")


if __name__ == "__main__":
    main()
