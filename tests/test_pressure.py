"""In-flight limits by work class (service/admission/pressure.py): adapting to latency, recovering once load is
gone, short queues per class, and light work never waiting behind heavy work (through HTTP too)."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from service.admission import pressure
from service.admission.pressure import RECOVER_S, ClassLimit, class_limits
from tests.conftest import run
from tests.helpers import assert_problem, wait_ready


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(pressure, "monotonic", clock)
    return clock


def answer(limit, kind, seconds, times=1):
    """`times` answers taking `seconds`, as many at once as the limit admits: in waves of min(times, limit) in
    flight (how much of its limit a class uses is what says whether its latency is its limit's doing)."""
    done = 0
    while done < times:
        wave = 0
        while wave < times - done and limit.admit():
            wave += 1
        assert wave > 0
        for _ in range(wave):
            limit.leave(kind, seconds)
        done += wave


def saturate(limit, kind, seconds):
    """One interval's answers with the whole limit in use (at least MIN_ANSWERS of them)."""
    answer(limit, kind, seconds, times=max(pressure.MIN_ANSWERS, limit.limit))


def fill_and_empty(limit):
    """Admit requests until one is turned away, then let them all go unanswered."""
    while limit.admit():
        pass
    for _ in range(limit.inflight):
        limit.leave()


def test_the_limit_falls_while_requests_queue_and_grows_back_when_they_do_not(clock):
    limit = ClassLimit("light", ceiling=64, floor=4, tolerance=2.0, max_wait_s=0.1)
    limit.limit = start = 16
    answer(limit, "search", 0.001, times=4)  # unqueued: a search takes 1 ms ...
    answer(limit, "get", 0.020, times=4)  # ... another kind 20 ms
    clock.now += 0.2
    answer(limit, "search", 0.005, times=8)  # searches take five times as long: they queue
    cut = int(start * 2.0 / 5.0)  # in proportion to the excess
    assert limit.limit == cut and limit.slowdown == pytest.approx(5.0)
    clock.now += 0.2
    fill_and_empty(limit)  # a full limit turns a request away ...
    answer(limit, "search", 0.001, times=6)
    answer(limit, "get", 0.020, times=2)  # ... and a mix of slow and fast kinds at their unqueued latency
    assert limit.limit == cut + 1 and limit.slowdown == pytest.approx(1.0)  # is no queueing
    clock.now += 0.2
    answer(limit, "search", 0.0025, times=8)  # a small excess: cut by a quarter
    assert limit.limit == int((cut + 1) * 0.75)
    for _ in range(20):
        clock.now += 0.2
        answer(limit, "get", 0.1, times=8)
    assert limit.limit == 4  # never below the floor
    for _ in range(100):
        clock.now += 0.2
        fill_and_empty(limit)
        answer(limit, "search", 0.001, times=8)
    assert limit.limit == 64  # never above the ceiling


def test_once_load_is_gone_the_limit_doubles_back_to_its_ceiling(clock):
    limit = ClassLimit("light", ceiling=128, floor=2, tolerance=1.5, max_wait_s=0.1)
    answer(limit, "search", 0.001, times=4)
    for _ in range(10):  # everything queues: cut to the floor
        clock.now += 0.2
        saturate(limit, "search", 0.01)
    assert limit.limit == 2
    clock.now += RECOVER_S * 0.9
    assert limit.current() == 2  # not yet: the last cut was under RECOVER_S ago
    clock.now += RECOVER_S * 0.2
    assert limit.current() == 4
    clock.now += 6 * RECOVER_S  # 2 -> 128 takes six doublings
    assert limit.current() == 128
    limit.limit, limit.inflight = 8, 5  # busy (over half its limit in use): no recovery, Vegas decides
    clock.now += 5 * RECOVER_S
    assert limit.current() == 8


def test_failures_and_unmeasured_kinds_do_not_move_the_limit(clock):
    limit = ClassLimit("light", ceiling=64, floor=4, tolerance=2.0, max_wait_s=0.1)
    answer(limit, "search", 0.001, times=4)
    clock.now += 0.2
    answer(limit, None, 5.0, times=20)  # failures (a 404, a refusal) say nothing of queueing
    answer(limit, "recall", 5.0, times=3)  # a kind seen fewer than four times has no unqueued latency yet
    assert limit.limit == 64 and limit.inflight == 0
    fixed = ClassLimit("light", ceiling=8, floor=4, tolerance=0, max_wait_s=0.1)  # tolerance 0: a fixed limit
    answer(fixed, "search", 0.001, times=4)
    clock.now += 0.2
    answer(fixed, "search", 1.0, times=8)
    assert fixed.limit == 8


def test_a_waiter_waits_a_few_times_what_its_kind_costs_unqueued():
    limit = ClassLimit("light", ceiling=2, floor=2, tolerance=1.5, max_wait_s=0.25)
    assert limit.wait_s("search") == 0.25  # unknown: the configured wait
    answer(limit, "search", 0.004, times=4)
    answer(limit, "tiny", 0.0001, times=4)
    assert limit.wait_s("search") == pytest.approx(0.004) and limit.wait_s("tiny") == pressure.MIN_WAIT_S

    async def go():
        assert limit.admit() and limit.admit()
        started = time.perf_counter()
        assert not await limit.enter("search")  # no slot within 4 ms: refused, not kept for 250 ms
        assert time.perf_counter() - started < 0.1

    run(go())


def test_a_request_waits_in_a_short_queue_for_a_slot_and_is_refused_at_once_when_it_is_full():
    async def go():
        limit = ClassLimit("light", ceiling=2, floor=2, tolerance=0, max_wait_s=0.05)
        assert await limit.enter() and await limit.enter()
        waiting = []
        for _ in range(4):
            assert not limit.full()
            waiting.append(asyncio.create_task(limit.enter()))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert len(limit.waiters) == 4 and limit.full()  # two waiters per slot: the queue is full ...
        started = time.perf_counter()
        assert not await limit.enter()  # ... so a newcomer is refused at once
        assert time.perf_counter() - started < 0.01
        limit.leave()  # a slot frees: handed to the first in line
        assert await waiting[0] and limit.inflight == 2
        assert not any(await asyncio.gather(*waiting[1:]))  # no slot in their 50 ms: refused
        assert limit.inflight == 2 and not limit.waiters

    run(go())


def test_the_queue_holds_only_the_waiters_a_slot_can_reach_within_their_wait():
    """Under overload a waiter that times out costs as much as an answer: the queue is as deep as the slots can take
    within a kind's wait (slots times wait over the mean hold), at least one, at most two per slot."""
    limit = ClassLimit("light", ceiling=2, floor=2, tolerance=1.5, max_wait_s=0.25)
    answer(limit, "search", 0.004, times=4)
    assert limit.hold_s == pytest.approx(0.004) and limit.wait_s("search") == pytest.approx(0.004)

    async def go():
        assert limit.admit() and limit.admit()
        limit.hold_s = 0.04  # slots now held ten times a search's wait: one waiter can be reached, not two
        assert not limit.full("search")
        waiting = asyncio.create_task(limit.enter("search"))
        await asyncio.sleep(0)
        assert limit.full("search") and not limit.full("unknown kind")  # the latter may wait the configured 250 ms
        started = time.perf_counter()
        assert not await limit.enter("search")  # refused at once, not after a wait in vain
        assert time.perf_counter() - started < 0.003
        limit.leave()
        assert await waiting
        limit.hold_s = 0.0001  # slots free often: two waiters per slot, as before anything was measured
        for _ in range(4):
            assert not limit.full("search")
            limit.waiters.append(asyncio.get_running_loop().create_future())
        assert limit.full("search")

    run(go())


def test_a_waiter_handed_a_slot_after_its_client_went_away_gives_it_back():
    async def go():
        limit = ClassLimit("light", ceiling=2, floor=1, tolerance=2.0, max_wait_s=5.0)
        assert await limit.enter() and await limit.enter()
        gone = asyncio.create_task(limit.enter())
        await asyncio.sleep(0.001)
        limit.leave()
        gone.cancel()  # handed a slot, then its client went away before it ran
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert limit.inflight == 1 and not limit.waiters

    run(go())


def test_each_work_class_has_its_own_share_and_queue():
    classes = class_limits(ceiling=8, floor=2, tolerance=0, max_wait_s=5.0)
    assert {name: work.ceiling for name, work in classes.items()} == {"light": 8, "write": 4, "heavy": 2, "job": 1}

    async def go():
        heavy, light = classes["heavy"], classes["light"]
        assert await heavy.enter() and await heavy.enter()
        backlog = [asyncio.create_task(heavy.enter()) for _ in range(4)]  # heavy work queues ...
        await asyncio.sleep(0.001)
        assert len(heavy.waiters) == 4
        assert [light.admit() for _ in range(9)] == [True] * 8 + [False]  # ... searches still get every slot
        heavy.leave()
        assert await backlog[0]
        for task in backlog[1:]:
            task.cancel()

    run(go())


def test_a_heavy_backlog_never_refuses_a_light_request_through_http(make_client):
    """Heavy requests queue past their share; meanwhile every search and listing is answered 200 at once."""
    client = make_client(raise_server_exceptions=False, max_inflight=8, inflight_latency_tolerance=0)
    wait_ready(client)

    async def slow_sql(*args, **kwargs):  # heavy work that takes a while (the engine's own work is not the point)
        await asyncio.sleep(0.8)
        raise LookupError("no SSB data")

    client.app.state.switchyard.olap.run_sql = slow_sql
    assert client.post("/v1/collections", json={"name": "lite", "dim": 2}).status_code == 201
    points = {"ids": [1, 2], "vectors": [[0, 1], [1, 0]]}
    assert client.put("/v1/collections/lite/points", json=points).status_code == 200

    def heavy(_):
        return client.post("/v1/olap/sql", json={"sql": "SELECT 1"}).status_code

    def timed(call):
        started = time.perf_counter()
        return call().status_code, time.perf_counter() - started

    with ThreadPoolExecutor(8) as pool:
        backlog = [pool.submit(heavy, i) for i in range(8)]  # more than the whole limit: heavy work queues
        time.sleep(0.2)
        light = [timed(lambda: client.post("/v1/collections/lite/search", json={"vector": [0, 1], "k": 1}))
                 for _ in range(5)] + [timed(lambda: client.get("/v1/collections")) for _ in range(5)]
        assert [status for status, _ in light] == [200] * 10
        assert max(seconds for _, seconds in light) < 0.2  # none waited for a heavy request to finish
        assert 503 in [f.result() for f in backlog]  # past its share and queue, heavy work itself was refused


def test_the_limit_returns_to_its_maximum_within_ten_seconds_of_the_load_ending(make_client):
    client = make_client(raise_server_exceptions=False, max_inflight=64, min_inflight=2,
                         inflight_latency_tolerance=1.5)
    wait_ready(client)
    light = client.app.express.admission.classes["light"]
    answer(light, "search", 0.001, times=4)
    for _ in range(12):  # everything queues: the limit collapses to its floor
        time.sleep(pressure.INTERVAL_S)
        saturate(light, "search", 0.05)
    assert light.limit == 2

    def gauge() -> float:
        text = client.get("/metrics").text
        return float(re.search(r'^switchyard_inflight_limit\{work="light"\} (\S+)$', text, re.M).group(1))

    ended = time.monotonic()
    while gauge() < 64:
        assert time.monotonic() - ended < 10, gauge()
        time.sleep(0.25)
    r = client.get("/v1/collections")
    assert r.status_code == 200 and gauge() == 64
    assert_problem(client.post("/v1/collections/none/search", json={"vector": [1.0], "k": 1}), 404, "not-found")


def full(work: ClassLimit) -> list[asyncio.Future]:
    """Every slot taken and the queue full (futures standing for waiters)."""
    work.limit = work.ceiling
    work.inflight = work.limit
    loop = asyncio.new_event_loop()
    waiters = [loop.create_future() for _ in range(2 * work.limit)]
    work.waiters.extend(waiters)
    return waiters


def test_with_its_class_full_a_request_is_refused_before_its_body_is_read(tmp_path):
    from service.http.app import create_app
    from service.http.express import QUEUED, Claim
    from service.settings import Settings

    app = create_app(Settings(data_dir=tmp_path, max_inflight=4, inflight_latency_tolerance=0))
    classes = app.express.admission.classes
    full(classes["heavy"])
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("express read the body of a request it refuses")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/olap/sql", "raw_path": b"/v1/olap/sql", "root_path": "",
             "query_string": b"", "headers": [(b"content-length", b"20"), (b"content-type", b"application/json")],
             "client": ("192.0.2.1", 4000), "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert b'"work_class":"heavy"' in sent[1]["body"].replace(b" ", b"")
    # A search the protocol holds is refused there, with the same problem, when the light class is full.
    full(classes["light"])
    answers, refusals = [], []
    claim = Claim("c1", "application/json", "")
    assert app.express.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append, refusals.append)[0]
    assert not answers and refusals[0].status == 503 and ("retry-after", "1") in refusals[0].headers
    assert b'"reason":"inflight"' in refusals[0].body.replace(b" ", b"")
    classes["light"].waiters.clear()  # the queue has room: the search takes its place there, to wait on the app's path

    async def queued() -> None:
        light = classes["light"]
        answered, _, place = app.express.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append,
                                                       refusals.append)
        assert not answered and place is not None and list(light.waiters) == [place.handed]
        light.leave()  # a slot frees: handed to that place before the request's task has started
        assert light.inflight == light.limit and not light.waiters
        ticket = await place.wait(app.express.admission)
        ticket.leave()
        assert light.inflight == light.limit - 1
        # A place whose request fails a step before it waits (its client went away while its task was starting) is
        # given back, with the slot handed to it meanwhile.
        light.inflight = light.limit
        _, _, gone = app.express.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append, refusals.append)
        light.leave()
        assert gone is not None and light.inflight == light.limit

        async def went_away() -> dict:
            return {"type": "http.disconnect"}

        scope["path"], scope["raw_path"] = "/v1/collections/c1/search", b"/v1/collections/c1/search"
        await app(scope | {QUEUED: gone}, went_away, send)
        assert light.inflight == light.limit - 1 and not light.waiters

    asyncio.run(queued())
    assert len(refusals) == 1


def test_the_protocol_refuses_a_request_whose_class_is_full_and_keeps_the_connection(make_settings, monkeypatch):
    """With its class full, a request is answered 503 by the HTTP protocol from its headers (Express.refusal, no
    ASGI cycle: the cheapest refusal); its body is skipped and the connection serves the next request. A request
    without the key, or of a class with room, goes on to the app."""
    from helpers import raw_socket, read_response
    from service.http.express_protocol import ExpressProtocol
    from test_slow_clients import KEY, request, serving

    cycles = []
    real_cycle = ExpressProtocol._app_headers_complete
    monkeypatch.setattr(ExpressProtocol, "_app_headers_complete", lambda self: (cycles.append(self.url),
                                                                                real_cycle(self)))
    settings = make_settings(api_key=KEY, max_inflight=4, inflight_latency_tolerance=0)
    with serving(settings) as (url, app):
        express = app.express
        sql = [(b"content-type", b"application/json"), (b"content-length", b"21"),
               (b"authorization", f"Bearer {KEY}".encode())]
        assert express.refusal(b"POST", b"/v1/olap/sql", sql) == (None, False)  # room: the app runs it
        full(express.admission.classes["heavy"])
        reply, screened = express.refusal(b"POST", b"/v1/olap/sql", sql)
        assert reply is not None and reply.status == 503 and ("retry-after", "1") in reply.headers and screened
        assert express.refusal(b"POST", b"/v1/olap/sql", sql[:2]) == (None, False)  # no key: the app answers 401
        assert express.refusal(b"GET", b"/v1/collections", sql[2:]) == (None, True)  # light work has room
        assert express.refusal(b"GET", b"/healthz", []) == (None, False)
        with raw_socket(url) as sock:
            sock.sendall(request("POST", "/v1/olap/sql", b'{"sql": "SELECT 1"}'))
            status, headers, body = read_response(sock)
            assert status == 503 and headers["retry-after"] == "1", body
            assert headers["content-type"].startswith("application/problem+json")
            problem = orjson.loads(body)
            assert problem["type"].endswith(":overloaded") and problem["work_class"] == "heavy", problem
            assert cycles == []  # answered by the protocol
            sock.sendall(request("GET", "/v1/collections"))  # the same connection: the body above was skipped
            status, _, body = read_response(sock)
            assert status == 200, body
            assert cycles == [b"/v1/collections"]


def test_light_work_slowed_by_heavy_work_cuts_the_heavy_limit_first(clock):
    classes = class_limits(ceiling=64, floor=8, tolerance=1.5, max_wait_s=0.1)
    light, heavy = classes["light"], classes["heavy"]
    answer(light, "search", 0.001, times=4)
    heavy.inflight = 3  # SSB queries running beside the searches
    for _ in range(2):
        clock.now += 0.2
        answer(light, "search", 0.004, times=8)  # searches take four times as long
    assert light.limit == 64 and heavy.limit == heavy.floor == 2  # heavy work gave way (16 -> 6 -> 2), to its floor
    clock.now += 0.2
    saturate(light, "search", 0.004)
    assert light.limit < 64  # nothing lower left to cut: light work's own limit (in use)
    heavy.inflight = 0
    clock.now += 0.2
    before = light.limit
    answer(classes["write"], "upsert", 0.001, times=4)
    saturate(light, "search", 0.004)
    assert light.limit < before and classes["write"].limit == 32  # idle lower classes are not cut


def test_a_class_using_little_of_its_limit_is_not_cut_for_being_slow(clock):
    """A lone client's requests slowed by something else (a noisy machine): the class uses 1 of its 128 slots, so
    its latency says nothing of its limit, which stays; the same slowdown with the limit in use cuts it."""
    limit = ClassLimit("light", ceiling=128, floor=2, tolerance=1.5, max_wait_s=0.1)
    answer(limit, "search", 0.001, times=4)
    for _ in range(20):
        clock.now += 0.2
        for _ in range(8):
            answer(limit, "search", 0.01)  # one at a time, ten times its unqueued latency
    assert limit.limit == 128 and limit.slowdown == pytest.approx(10.0)
    clock.now += 0.2
    answer(limit, "search", 0.01, times=64)  # half the limit in flight at once: now it is the limit's doing
    assert limit.limit == int(128 * 0.25)


def test_heavy_threads_run_at_a_lower_priority_than_the_event_loop():
    import os
    import threading

    from service.admission.priority import HEAVY_NICE, lower_priority

    seen = {}

    def worker():
        lower_priority()
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == min(19, mine + HEAVY_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # only that thread


def test_a_database_process_leading_its_own_session_is_lowered_as_a_group_too(tmp_path):
    """PostgreSQL's backends each lead a session; where the kernel schedules sessions as groups (autogroup), a
    nice value ranks a process only within its group, so the group's own nice value must be lowered as well."""
    import os
    import subprocess
    from pathlib import Path

    from service.admission.priority import BACKGROUND_NICE, lower_process_priority

    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        group = Path(f"/proc/{child.pid}/autogroup")
        if not group.exists():
            pytest.skip("this kernel does not group sessions for scheduling (no autogroup)")
        before, ours = os.getpriority(os.PRIO_PROCESS, child.pid), Path("/proc/self/autogroup").read_text()
        lower_process_priority(child.pid)
        nice = max(before, BACKGROUND_NICE)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == nice
        assert group.read_text().split()[-1] == str(nice), group.read_text()
        assert Path("/proc/self/autogroup").read_text() == ours  # this process's group is not touched
    finally:
        child.kill()
        child.wait()
