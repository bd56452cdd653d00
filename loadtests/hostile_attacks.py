"""The hostile-client suite's resource attacks (issue 34, items 1-4 and 6-8): each sends what the issue's probe sent
and checks that the service answered as the issue demands. Memory, in-flight slots and the honest client are
watched by the runner (loadtests/hostile.py); these functions record statuses and checks in their Ctx."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from loadtests.hostile_kit import HONEST_COLLECTION, Ctx, metrics_gauges

ARROW = "application/vnd.apache.arrow.stream"


def seed_collection(ctx: Ctx, name: str, rows: int, dim: int = 4, metric: str = "l2",
                    payload: dict[str, Any] | None = None) -> None:
    """A fresh collection of `rows` random points (JSON upserts in chunks), set up before the attack proper."""
    with ctx.client(timeout_s=300) as http:
        http.delete(f"/v1/collections/{name}")
        http.post("/v1/collections", json={"name": name, "dim": dim, "metric": metric}).raise_for_status()
        rng = np.random.default_rng(5)
        for start in range(0, rows, 5000):
            n = min(5000, rows - start)
            body: dict[str, Any] = {"ids": list(range(start, start + n)),
                                    "vectors": rng.standard_normal((n, dim)).round(4).tolist()}
            if payload is not None:
                body["payloads"] = [payload] * n
            http.put(f"/v1/collections/{name}/points", json=body).raise_for_status()


# -- 1: keyless slow bodies and a half-sent search ------------------------------------------------------------

def slow_bodies(ctx: Ctx) -> None:
    """N sockets send `POST /v1/collections`, Content-Length 1000 and the body `{` with no key and hold on; one more
    half-sends a search, and `keyed` more half-send a search with the key. Demanded: each keyless one is answered
    401 (or closed) at once and takes no in-flight slot; after hold_s (the issue's 20 s) none is still open; the
    honest client (the runner's) is never refused."""
    t = ctx.target
    try:
        limit = int(metrics_gauges(t.url, t.headers()).get("switchyard_inflight_limit", 128))
    except httpx.HTTPError:
        limit = 128
    n = min(ctx.params["max_sockets"], max(ctx.params["min_sockets"], limit + ctx.params["extra"]))
    ctx.note(f"{n} keyless sockets (in-flight limit {limit}), 1 keyless and {ctx.params['keyed']} keyed half-sent "
             f"searches, held {ctx.params['hold_s']} s")
    heads = [b"POST /v1/collections HTTP/1.1\r\nHost: hostile\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{"] * n
    search = (f"POST /v1/collections/{HONEST_COLLECTION}/search HTTP/1.1\r\nHost: hostile\r\n"
              "Content-Type: application/json\r\nContent-Length: 1000\r\n")
    heads.append(f"{search}\r\n{{\"vector\": [0.1,".encode())
    # With the key, a body that never ends may cost a socket, and no more once its read deadline passes.
    keyed = [f"{search}Authorization: Bearer {t.key}\r\n\r\n{{\"vector\": [0.1,".encode()] * ctx.params["keyed"]
    heads += keyed if t.key else []
    sockets: list[socket.socket] = []
    try:
        for head in heads:
            s = socket.create_connection(("127.0.0.1", t.port), timeout=5)
            s.sendall(head)
            sockets.append(s)
        time.sleep(min(1.0, ctx.params["hold_s"]))
        try:
            inflight = metrics_gauges(t.url, t.headers()).get("switchyard_inflight", 0)
            ctx.expect("keyless requests hold no in-flight slot", inflight < n / 2,
                       f"switchyard_inflight {inflight:g} with {n + 1} keyless requests open")
        except httpx.HTTPError as exc:
            ctx.expect("keyless requests hold no in-flight slot", False, f"/metrics: {exc!r}")
        time.sleep(max(0.0, min(ctx.params["hold_s"] - 1.0, ctx.left() - 5)))
        answered: Counter[str] = Counter()
        still_open = 0
        for s in sockets:
            s.setblocking(False)
            try:
                data = s.recv(4096)
                answered[data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"] += 1
            except BlockingIOError:
                still_open += 1
            except OSError:
                answered["reset"] += 1
        for status, count in answered.items():
            ctx.statuses[status] += count
        ctx.expect("every keyless slow request answered or closed", still_open == 0,
                   f"{still_open} of {len(sockets)} still open after {ctx.params['hold_s']} s; "
                   f"answers {dict(answered)}")
    finally:
        for s in sockets:
            s.close()


# -- 2: one upsert with many distinct payload keys ------------------------------------------------------------

def payload_keys(ctx: Ctx) -> None:
    """One point with `keys` distinct top-level payload keys into a collection of `rows` rows, for each variant.
    Demanded: memory bounded by the data present, or a clear 422 for too many keys (the runner checks RSS)."""
    bodies = []  # built before the window: an attacker's own CPU is not the service's
    for i, (rows, keys) in enumerate(ctx.params["variants"]):
        seed_collection(ctx, f"hostile_keys{i}", rows)
        payload = {f"key_{j}": j for j in range(keys)}
        bodies.append(orjson.dumps({"ids": [0], "vectors": [[1, 0, 0, 0]], "payloads": [payload]}))
    ctx.begin()
    for i, ((rows, keys), body) in enumerate(zip(ctx.params["variants"], bodies)):
        name = f"hostile_keys{i}"
        with ctx.client() as http:
            r = ctx.send(http, "PUT", f"/v1/collections/{name}/points", content=body,
                         headers={"Content-Type": "application/json"})
            ctx.expect_answer(f"{keys:,} payload keys on {rows:,} rows: stored or refused", r, "2xx|4xx")
            r = ctx.send(http, "POST", f"/v1/collections/{name}/search",
                         json={"vector": [1, 0, 0, 0], "k": 3, "filter": {f"key_{keys - 1}": keys - 1}})
            ctx.expect_answer("a filtered search afterwards", r, "2xx")
            http.delete(f"/v1/collections/{name}")


# -- 3: recall with a huge sample -----------------------------------------------------------------------------

def recall_matrix(ctx: Ctx) -> None:
    """`POST .../recall {"sample": S, "k": 10}` on a collection of `rows` rows. Demanded: recall batched, memory
    bounded whatever the rows (the runner checks RSS); answered 200 or refused with a 4xx."""
    seed_collection(ctx, "hostile_recall", ctx.params["rows"])
    ctx.begin()
    with ctx.client(timeout_s=ctx.params["timeout_s"]) as http:
        r = ctx.send(http, "POST", "/v1/collections/hostile_recall/recall",
                     json={"sample": ctx.params["sample"], "k": 10})
        ctx.expect_answer(f"recall sample {ctx.params['sample']:,} on {ctx.params['rows']:,} rows", r, "2xx|4xx")
        http.delete("/v1/collections/hostile_recall")


# -- 4: many distinct large filters ---------------------------------------------------------------------------

def filter_cache(ctx: Ctx) -> None:
    """Rounds of distinct large filters (about `filter_kb` KB each, an `$in` of long strings). Demanded: caches
    and learnt-cost tables bounded, so RSS stops growing (the runner checks it); every search answered."""
    seed_collection(ctx, "hostile_filters", 2000, payload={"tag": "a"})
    ctx.begin()
    values = max(1, min(1024, ctx.params["filter_kb"] * 1024 // 52))
    bad = 0
    with ctx.client() as http:
        for rnd in range(ctx.params["rounds"]):
            for i in range(ctx.params["filters"]):
                if ctx.left() < 5:
                    ctx.note(f"stopped at round {rnd}, filter {i}: out of time")
                    break
                pad = f"{rnd:03d}-{i:06d}-".ljust(48, "x")
                body = {"vector": [1, 0, 0, 0], "k": 5,
                        "filter": {"tag": {"$in": [f"{pad}{j:04d}" for j in range(values)]}}}
                r = ctx.send(http, "POST", "/v1/collections/hostile_filters/search", json=body)
                bad += r is None or r.status_code != 200
        ctx.expect("every filtered search answered 200", bad == 0, f"{bad} not 200")
        http.delete("/v1/collections/hostile_filters")


# -- 6: a JSON body under an Arrow Content-Type ---------------------------------------------------------------

def content_type(ctx: Ctx) -> None:
    """A JSON upsert over the JSON body limit, sent as Arrow with odd casing, with parameters, and with two
    Content-Type headers (Arrow first, JSON last). Demanded: one Content-Type parse, so each is refused (413, or
    a 4xx for a body that is no Arrow stream) and nothing is committed."""
    limit = int(ctx.target.env.get("SWITCHYARD_MAX_BODY_BYTES", 64 * 2**20))
    size = int(limit * 1.1)
    seed_collection(ctx, "hostile_ctype", 4)
    head = b'{"ids": [100], "vectors": [[1, 0, 0, 0]], "payloads": [{"pad": "'
    body = head + b"x" * (size - len(head) - 4) + b'"}]}'  # built before the window, as payload_keys' bodies
    ctx.begin()
    ctx.note(f"{len(body) / 2**20:.1f} MiB JSON bodies against a {limit / 2**20:.1f} MiB limit")
    variants: list[tuple[str, list[tuple[str, str]]]] = [
        ("application/json (the control)", [("Content-Type", "application/json")]),
        ("Application/vnd.apache.arrow.stream", [("Content-Type", "Application/vnd.apache.arrow.stream")]),
        ("upper case with a parameter", [("Content-Type", ARROW.upper() + "; charset=utf-8")]),
        ("two headers, Arrow first", [("Content-Type", "Application/Vnd.Apache.Arrow.Stream"),
                                      ("Content-Type", "application/json")]),
        ("two headers, JSON first", [("Content-Type", "application/json"), ("Content-Type", ARROW)]),
    ]
    with ctx.client(timeout_s=120) as http:
        for label, headers in variants:
            if ctx.left() < 10:
                ctx.note(f"out of time before {label}")
                break
            r = ctx.send(http, "PUT", "/v1/collections/hostile_ctype/points", content=body,
                         headers=httpx.Headers([*headers, *ctx.target.headers().items()]))
            ctx.expect_answer(f"{label}: refused", r, "4xx")
            if r is not None and r.status_code == 202:  # a bulk job accepted it: let it finish before counting
                time.sleep(2)
        info = http.get("/v1/collections/hostile_ctype").json()
        ctx.expect("nothing committed", info.get("count") == 4, f"count {info.get('count')} (4 seeded)")
        http.delete("/v1/collections/hostile_ctype")


# -- 7: a huge declared frame to an engine link ---------------------------------------------------------------

def _engine_sockets(ctx: Ctx) -> list[str]:
    """The engine processes' call sockets (front/engine layout), read from the links the service handed down."""
    found: set[str] = set()
    for process in ctx.target.service_processes():
        try:
            raw = process.environ().get("_SWITCHYARD_PROCESS_LINKS")
        except psutil.Error:
            continue
        if raw:
            found.update(calls for calls, _ in json.loads(raw)["engines"])
    return sorted(found)


def frame_flood(ctx: Ctx) -> None:
    """An unsigned frame declaring `declared_mb` MB, `send_mb` MB of it sent, to an engine process's link.
    Demanded: frame size limits before buffering: the engine drops the link at the header, memory flat. Targets
    the unix socket of a front/engine layout; skipped where the service has no engine link this suite can reach
    (the Ray layout's TCP links need a Ray cluster)."""
    paths = _engine_sockets(ctx)
    if not paths:
        ctx.skipped = "no engine link: the service runs without front processes (SWITCHYARD_FRONTS=0)"
        return
    declared, chunk = ctx.params["declared_mb"] * 2**20, b"\0" * 2**20
    sent = 0
    ctx.note(f"engine link {paths[0]}: declared {ctx.params['declared_mb']} MB, up to {ctx.params['send_mb']} MB sent")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(paths[0])
        try:
            s.sendall(struct.pack("!I", declared))
            while sent < ctx.params["send_mb"] * 2**20 and ctx.left() > 5:
                s.sendall(chunk)
                sent += len(chunk)
            outcome = "all sent"
            time.sleep(1)  # what the engine holds now, the runner's watch sees
        except (BrokenPipeError, ConnectionResetError) as exc:
            outcome = type(exc).__name__
        except TimeoutError:
            outcome = "stalled (the engine stopped reading)"
    ctx.statuses[outcome] += 1
    ctx.expect("the link dropped before the frame was buffered", outcome != "all sent" and sent < 8 * 2**20,
               f"{outcome} after {sent / 2**20:.0f} MB")


# -- 8: rotating bearer tokens against the quota ---------------------------------------------------------------

def quota_rotation(ctx: Ctx) -> None:
    """Requests with a new `Bearer junkN` each. With a key configured: every one 401 (a junk token is no
    identity, gets no bucket, costs the honest key nothing). Without one: they share the client's bucket, so at
    most the quota's worth is served."""
    n, served = ctx.params["requests"], 0
    body = orjson.dumps({"vector": [0.0] * 16, "k": 1})
    started = time.monotonic()
    with ctx.client(key=False, timeout_s=10) as http:
        for i in range(n):
            if ctx.left() < 3:
                break
            r = ctx.send(http, "POST", f"/v1/collections/{HONEST_COLLECTION}/search", content=body,
                         headers={"Authorization": f"Bearer junk{i}", "Content-Type": "application/json"})
            served += r is not None and r.status_code == 200
    elapsed = time.monotonic() - started
    env = ctx.target.env
    if ctx.target.key:
        ctx.expect("no junk token served", served == 0, f"{served} of {n} answered 200")
        ctx.expect("junk tokens answered 401", ctx.statuses.get("401", 0) == n,
                   f"statuses {dict(ctx.statuses)}")
        return
    rate = float(env.get("SWITCHYARD_QUOTA_REQUESTS_PER_S", 0))
    burst = float(env.get("SWITCHYARD_QUOTA_BURST", 0)) or 2 * rate
    allowed = burst + rate * elapsed
    ctx.expect("rotating tokens share one client's quota", served <= 1.2 * allowed + 2,
               f"{served} of {n} served in {elapsed:.1f} s; the quota allows about {allowed:.0f}")
