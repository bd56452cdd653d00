"""Arrow IPC bodies for bulk loads, and OLAP answers as tables (pyarrow: `pip install switchyard-client[arrow]`)."""

from __future__ import annotations

import tempfile
from typing import Any, BinaryIO, Sequence

import numpy as np

from ._wire import dumps


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ImportError("this call needs pyarrow: pip install 'switchyard-client[arrow]'") from None
    return pyarrow


def points_stream(ids: np.ndarray, vectors: np.ndarray, payloads: Sequence[dict[str, Any] | None] | None,
                  rows_per_batch: int) -> BinaryIO:
    """One Arrow IPC stream (id int64, vector fixed_size_list<float32>, payload JSON text when given) in a temporary
    file, written a batch at a time: a load of any size costs one batch of memory beside the caller's arrays."""
    pa = _pyarrow()
    if len(ids) != len(vectors):
        raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
    if payloads is not None and len(payloads) != len(ids):
        raise ValueError(f"{len(payloads)} payloads for {len(ids)} ids")
    dim = vectors.shape[1]
    fields = [pa.field("id", pa.int64()), pa.field("vector", pa.list_(pa.float32(), dim))]
    if payloads is not None:
        fields.append(pa.field("payload", pa.string()))
    schema = pa.schema(fields)
    spool = tempfile.TemporaryFile(prefix="switchyard-load-")
    sink = pa.PythonFile(spool, mode="w")
    with pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, len(ids), rows_per_batch):
            stop = start + rows_per_batch
            columns = [pa.array(ids[start:stop], pa.int64()),
                       pa.FixedSizeListArray.from_arrays(pa.array(vectors[start:stop].reshape(-1)), dim)]
            if payloads is not None:
                columns.append(pa.array([None if p is None else dumps(p).decode() for p in payloads[start:stop]],
                                        pa.string()))
            writer.write_batch(pa.record_batch(columns, schema=schema))
    spool.seek(0)
    return spool


def answer_table(answer: dict[str, Any]) -> Any:
    """An OLAP answer (columns, rows) as a pyarrow Table; the answer's engine, took_ms and fallback are kept in the
    schema's metadata."""
    pa = _pyarrow()
    columns = answer["columns"]
    names = [c["name"] if isinstance(c, dict) else str(c) for c in columns]
    data = {name: [row[i] for row in answer["rows"]] for i, name in enumerate(names)}
    meta = {key: str(answer[key]) for key in ("engine", "took_ms", "fallback", "truncated", "row_count")
            if answer.get(key) is not None}  # no "None" strings: a key that is absent had no value
    return pa.table(data).replace_schema_metadata(meta)
