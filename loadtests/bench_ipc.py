"""The hop between an HTTP front process and an engine process, measured before building on it.

    python loadtests/bench_ipc.py [--dim 768 --clients 1,16 --duration 3]

A front process (asyncio, as a Uvicorn worker is) sends single-vector "searches" to an engine process and
awaits the answers: a msgpack header plus the raw float32 vector out, a header plus ids and distances back.
Engine work is nil, so what is measured is the hop: round trips per second, latency, and CPU per round trip of
both processes together. Compared side by side:
- zmq: pyzmq DEALER (zmq.asyncio) to ROUTER over ipc://, multipart frames, no copies of the vector;
- pipe: a multiprocessing Pipe read through the event loop (length-prefixed msgpack);
- thread: today's hop inside one process, loop.run_in_executor to a thread (what the micro-batcher does).
Writes JSON under results_dir("ipc") (loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import psutil

from benchkit import results_dir, save_json, versions

RESULTS = results_dir("ipc")
K = 10


def _answer(vector: bytes) -> tuple[bytes, bytes]:
    ids = np.arange(K, dtype=np.int64).tobytes()
    return ids, np.zeros(K, dtype=np.float32).tobytes()


# -- engines ---------------------------------------------------------------------------------------------------
def zmq_engine(address: str, ready: Any) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while True:
        ident, header, vector = sock.recv_multipart(copy=False)
        meta = msgpack.unpackb(header.bytes)
        if meta.get("stop"):
            sock.send_multipart([ident, header])
            return
        ids, distances = _answer(vector.buffer)
        sock.send_multipart([ident, msgpack.packb({"n": meta["n"]}), ids, distances], copy=False)


def pipe_engine(conn: Any, ready: Any) -> None:
    ready.set()
    while True:
        message = conn.recv_bytes()
        (length,) = struct.unpack_from("<I", message)
        meta = msgpack.unpackb(message[4:4 + length])
        if meta.get("stop"):
            return
        ids, distances = _answer(message[4 + length:])
        header = msgpack.packb({"n": meta["n"]})
        conn.send_bytes(struct.pack("<I", len(header)) + header + ids + distances)


# -- fronts ----------------------------------------------------------------------------------------------------
async def closed_loop(call: Any, clients: int, duration_s: float) -> dict[str, Any]:
    latencies: list[float] = []
    stop = time.perf_counter() + duration_s

    async def client(c: int) -> None:
        i = c
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t)
            i += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"round_trips_per_s": round(len(latencies) / elapsed),
            "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
            "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1), "round_trips": len(latencies)}


def _cpu(pids: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


async def measure(name: str, call: Any, pids: list[int], clients: list[int], duration_s: float) -> list[dict[str, Any]]:
    await closed_loop(call, 1, 0.3)  # warm
    rows = []
    for n in clients:
        cpu0 = _cpu(pids)
        row = await closed_loop(call, n, duration_s)
        row["cpu_us_per_round_trip"] = round((_cpu(pids) - cpu0) / row["round_trips"] * 1e6, 1)
        row.update(transport=name, clients=n)
        print(f"  {name:>6}, {n:>3} clients: {row['round_trips_per_s']:>7,} round trips/s, p50 {row['p50_us']} us, "
              f"CPU {row['cpu_us_per_round_trip']} us per round trip", flush=True)
        rows.append(row)
    return rows


async def run_zmq(vectors: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    import zmq
    import zmq.asyncio

    address = f"ipc://{tempfile.mkdtemp()}/engine"
    ready = mp.Event()
    engine = mp.Process(target=zmq_engine, args=(address, ready), daemon=True)
    engine.start()
    ready.wait()
    sock = zmq.asyncio.Context().socket(zmq.DEALER)
    sock.connect(address)
    waiting: dict[int, asyncio.Future] = {}
    loop = asyncio.get_running_loop()

    async def reader() -> None:
        while True:
            header, ids, distances = await sock.recv_multipart(copy=False)
            waiting.pop(msgpack.unpackb(header.bytes)["n"]).set_result((ids.bytes, distances.bytes))

    task = loop.create_task(reader())
    counter = iter(range(1 << 62))

    async def call(i: int) -> Any:
        n = next(counter)
        waiting[n] = future = loop.create_future()
        await sock.send_multipart([msgpack.packb({"n": n, "k": K}), vectors[i % len(vectors)]], copy=False)
        return await future

    rows = await measure("zmq", call, [os.getpid(), engine.pid], args.clients, args.duration)
    task.cancel()
    engine.kill()
    return rows


async def run_pipe(vectors: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    front, back = mp.Pipe()
    ready = mp.Event()
    engine = mp.Process(target=pipe_engine, args=(back, ready), daemon=True)
    engine.start()
    ready.wait()
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future] = {}

    def readable() -> None:
        while front.poll():
            message = front.recv_bytes()
            (length,) = struct.unpack_from("<I", message)
            waiting.pop(msgpack.unpackb(message[4:4 + length])["n"]).set_result(message[4 + length:])

    loop.add_reader(front.fileno(), readable)
    counter = iter(range(1 << 62))

    async def call(i: int) -> Any:
        n = next(counter)
        waiting[n] = future = loop.create_future()
        header = msgpack.packb({"n": n, "k": K})
        front.send_bytes(struct.pack("<I", len(header)) + header + vectors[i % len(vectors)].tobytes())
        return await future

    rows = await measure("pipe", call, [os.getpid(), engine.pid], args.clients, args.duration)
    loop.remove_reader(front.fileno())
    engine.kill()
    return rows


async def run_thread(vectors: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    executor = ThreadPoolExecutor(2)
    loop = asyncio.get_running_loop()

    async def call(i: int) -> Any:
        return await loop.run_in_executor(executor, _answer, vectors[i % len(vectors)].tobytes())

    return await measure("thread", call, [os.getpid()], args.clients, args.duration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=3)
    parser.add_argument("--transports", default="thread,pipe,zmq")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    vectors = np.random.default_rng(0).standard_normal((1000, args.dim)).astype(np.float32)
    runners = {"zmq": run_zmq, "pipe": run_pipe, "thread": run_thread}
    rows = []
    for name in args.transports.split(","):
        rows += asyncio.run(runners[name](vectors, args))
    report = {"what": "front-to-engine hop, nil engine work", "dim": args.dim, "k": K, "rows": rows,
              "versions": versions("pyzmq", "msgpack", "numpy")}
    path = RESULTS / f"bench_ipc-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save_json(path, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
