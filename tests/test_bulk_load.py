"""Arrow bulk loads: spooled to disk as they arrive, checked whole before anything is written, loaded a chunk
at a time, and the spool file removed however the load ends."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pytest

from helpers import assert_problem, wait_job, wait_ready
from indexes.errors import InvalidInput
from indexes.vectors import arrow_chunks, check_arrow
from service.jobs import spool
from vector_data import clustered

DIM = 8
ARROW = {"content-type": "application/vnd.apache.arrow.stream"}


def batches(vectors: np.ndarray, first_id: int = 0, sizes=(5, 1, 12, 3, 9), payload: bool = True,
            fixed: bool = True):
    """Record batches of uneven sizes covering `vectors`, ids from first_id; vectors as fixed-size lists, or as
    plain lists (whose lengths a schema does not fix)."""
    out, start = [], 0
    for size in sizes:
        end = min(len(vectors), start + size)
        if end <= start:
            break
        columns = {"id": pa.array(range(first_id + start, first_id + end), pa.int64()),
                   "vector": (pa.FixedSizeListArray.from_arrays(pa.array(vectors[start:end].reshape(-1)),
                                                                vectors.shape[1])
                              if fixed else pa.array(vectors[start:end].tolist(), pa.list_(pa.float32())))}
        if payload:
            columns["payload"] = pa.array([f'{{"n": {i}}}' for i in range(first_id + start, first_id + end)])
        out.append(pa.record_batch(columns))
        start = end
    return out


def stream(record_batches) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, record_batches[0].schema) as writer:
        for batch in record_batches:
            writer.write_batch(batch)
    return sink.getvalue()


def test_arrow_chunks_read_a_stream_a_few_rows_at_a_time(tmp_path):
    vectors = clustered(30, DIM, seed=3)
    path = tmp_path / "load.arrows"
    path.write_bytes(stream(batches(vectors)))
    chunks = list(arrow_chunks(path, DIM, rows=7))
    assert [len(c.ids) for c in chunks] == [7, 7, 7, 7, 2]  # batches of 5, 1, 12, 3, 9 cut and joined
    np.testing.assert_array_equal(np.concatenate([c.ids for c in chunks]), np.arange(30))
    np.testing.assert_array_equal(np.concatenate([c.vectors for c in chunks]), vectors)
    assert [p for c in chunks for p in c.payloads][12] == b'{"n":12}'
    assert check_arrow(path, DIM) == 30


@pytest.mark.parametrize("bad", ['{"n": 1e309}', '{"n": "x\\u0000"}', "not json"])
def test_a_bad_payload_is_named_by_its_row_in_the_whole_stream(tmp_path, bad):
    """Chunks are checked one at a time; the refusal names the payload's row in the stream, not in its chunk."""
    record_batches = batches(clustered(30, DIM, seed=3))
    payloads = record_batches[2].column("payload").to_pylist()  # rows 6-17
    payloads[10] = bad  # row 16, the third of the third chunk of 7
    record_batches[2] = record_batches[2].set_column(2, "payload", pa.array(payloads))
    path = tmp_path / "load.arrows"
    path.write_bytes(stream(record_batches))
    with pytest.raises(InvalidInput) as caught:
        list(arrow_chunks(path, DIM, rows=7))
    assert caught.value.field == "payloads[16]"


@pytest.mark.parametrize("make, field", [
    (lambda v: stream(batches(v) + batches(v[:2], first_id=3)), "ids"),  # id 3 again, in a later batch
    (lambda v: stream(batches(v, sizes=(10,), fixed=False)
                      + batches(np.ones((2, DIM + 1), np.float32), 50, fixed=False)),
     "vector"),
    (lambda v: stream([pa.record_batch({"key": pa.array([1])})]), "body"),
    (lambda v: b"\0" * 100, "body"),
    (lambda v: stream(batches(v))[:-40], "body"),  # cut off mid-batch
])
def test_a_bad_stream_is_refused_whole_naming_the_field(tmp_path, make, field):
    path = tmp_path / "bad.arrows"
    path.write_bytes(make(clustered(30, DIM, seed=4)))
    with pytest.raises(InvalidInput) as bad:
        check_arrow(path, DIM)
    assert bad.value.field == field


def test_spool_clear_removes_only_the_files_of_processes_that_are_gone(tmp_path):
    directory = spool.spool_dir(tmp_path)
    directory.mkdir()
    mine, dead = directory / f"{os.getpid()}-a.arrows", directory / "999999999-b.arrows"
    mine.write_bytes(b"x")
    dead.write_bytes(b"x")
    spool.clear(tmp_path)
    assert mine.exists() and not dead.exists()


def test_a_chunked_bulk_load_is_spooled_loaded_and_its_file_removed(make_client, tmp_path):
    client = make_client()
    wait_ready(client)
    client.post("/v1/collections", json={"name": "loaded", "dim": DIM})
    vectors = clustered(300, DIM, seed=6)
    body = stream(batches(vectors, sizes=(40,) * 8))

    def pieces():  # no Content-Length: the body arrives chunked
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    r = client.put("/v1/collections/loaded/points", content=pieces(), headers=ARROW)
    assert r.status_code == 202, r.text
    job = wait_job(client, r.headers["location"])
    assert job["state"] == "succeeded" and job["done"] == job["total"] == 300, job
    assert client.get("/v1/collections/loaded").json()["count"] == 300
    hit = client.post("/v1/collections/loaded/search", json={"vector": vectors[123].tolist(), "k": 1}).json()
    assert hit["ids"] == [123]
    filtered = client.post("/v1/collections/loaded/search", json={"vector": vectors[0].tolist(), "k": 3,
                                                                  "filter": {"n": 251}}).json()
    assert filtered["ids"] == [251]  # payloads came through
    assert not list(spool.spool_dir(tmp_path / "data").iterdir())  # the spool file went with the job


def test_a_bad_bulk_load_writes_nothing_and_leaves_no_file(make_client, tmp_path):
    client = make_client(raise_server_exceptions=False)
    wait_ready(client)
    client.post("/v1/collections", json={"name": "refused", "dim": DIM})
    vectors = clustered(100, DIM, seed=7)
    wrong = stream(batches(vectors, sizes=(40, 40), fixed=False)
                   + batches(np.ones((3, DIM + 2), np.float32), first_id=500, fixed=False))
    r = client.put("/v1/collections/refused/points", content=wrong, headers=ARROW)
    body = assert_problem(r, 422, "validation-error")
    assert body["field"] == "vector" and "dimension" in body["detail"]
    assert client.get("/v1/collections/refused").json()["count"] == 0  # the 80 good rows before it were not loaded
    assert not list(spool.spool_dir(tmp_path / "data").iterdir())
    r = client.put("/v1/collections/nothere/points", content=stream(batches(vectors)), headers=ARROW)
    assert_problem(r, 404, "not-found")
    assert not spool.spool_dir(tmp_path / "data").exists() or not list(spool.spool_dir(tmp_path / "data").iterdir())


def test_a_bulk_load_cancelled_while_queued_removes_its_file(make_client, tmp_path):
    client = make_client(max_jobs=1)
    wait_ready(client)
    client.post("/v1/collections", json={"name": "queued", "dim": DIM})
    vectors = clustered(200, DIM, seed=8)
    first = client.put("/v1/collections/queued/points", content=stream(batches(vectors, sizes=(50,) * 4)),
                       headers=ARROW)
    second = client.put("/v1/collections/queued/points", content=stream(batches(vectors, 1000, sizes=(50,) * 4)),
                        headers=ARROW)
    assert first.status_code == second.status_code == 202
    cancelled = client.post(second.headers["location"] + "/cancel").json()
    assert wait_job(client, first.headers["location"])["state"] == "succeeded"
    assert cancelled["state"] in ("cancelled", "succeeded")  # it may have run before the cancel came
    assert not list(spool.spool_dir(tmp_path / "data").iterdir())


class _Body:
    """A request whose body is `first`, then more that must not be read (the test fails if it is)."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        self.headers = {"content-length": str(70 * 2**20)}

    async def stream(self):
        yield self.first
        raise AssertionError("the body was read past its first piece")


@pytest.mark.parametrize("first", [b'{"ids": [1], "vectors": [[1, 0, 0, 0]], "payloads": [{"pad": "xxxx',
                                   b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x04\x15\x00\x12\x00"])
def test_a_body_that_is_no_arrow_stream_is_refused_from_its_first_bytes(tmp_path, first):
    """JSON (or Parquet) sent with the Arrow content type: refused once its first bytes are in, before the rest
    of a 70 MB body is read or written to disk, and no spool file is left."""
    from conftest import run
    from indexes.vectors import check_arrow_stream_start
    from service.errors import Unprocessable
    from service.jobs.disk import DiskLedger

    ledger = DiskLedger(tmp_path, 0, None)
    with pytest.raises(Unprocessable, match="not an Arrow IPC stream") as refused:
        run(spool.spool(_Body(first), ledger, "a bulk load", check_start=check_arrow_stream_start))
    # a 422 naming the body; the connection is closed, so the unread rest is never drained through the event loop
    assert refused.value.field == "body" and refused.value.headers == {"Connection": "close"}
    assert not list(spool.spool_dir(tmp_path).iterdir())


def test_a_real_stream_passes_the_check_of_its_first_bytes():
    from indexes.vectors import check_arrow_stream_start

    data = stream(batches(clustered(10, DIM, seed=2)))
    check_arrow_stream_start(data[:spool.START_BYTES])  # the continuation marker
    legacy = pa.BufferOutputStream()
    schema = pa.schema([("id", pa.int64())])
    with pa.ipc.new_stream(legacy, schema, options=pa.ipc.IpcWriteOptions(use_legacy_format=True)) as writer:
        writer.write_batch(pa.record_batch([pa.array([1, 2])], schema=schema))
    check_arrow_stream_start(legacy.getvalue().to_pybytes()[:spool.START_BYTES])  # the legacy format: a length
