"""The resident payload index: typed columns of each top-level payload key, row for row with a resident
collection, evaluated to a row mask in memory (no PostgreSQL round trip per filtered search).

Every key seen becomes a column (inferred, and reported by `describe`):
- `kind`: uint8 per row, what the value is (absent, null, false, true, number, string, other);
- `number`: float64 per row, allocated once a number is seen (NaN elsewhere);
- `code`: int32 per row into the key's string vocabulary, allocated once a string is seen (-1 elsewhere).
  Each vocabulary entry also has its instant (filters.instant, NaN for non-dates), so date ranges cost a gather.
A column costs 1 + 8 + 4 bytes a row at most. Rows only append; a compaction takes the surviving rows (`take`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from .filters import And, Cond, Node, Not, Or, instant

ABSENT, NULL, FALSE, TRUE, NUMBER, STRING, OTHER = range(7)
KIND_NAMES = ("absent", "null", "false", "true", "number", "string", "other")
_COMPARE = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}


class Column:
    def __init__(self, capacity: int) -> None:
        self.kind = np.zeros(capacity, dtype=np.uint8)
        self.number: np.ndarray | None = None
        self.code: np.ndarray | None = None
        self.vocab: dict[str, int] = {}
        self.instants: list[float] = []

    def grow(self, capacity: int, rows: int) -> None:
        self.kind = _grown(self.kind, capacity, rows, 0)
        if self.number is not None:
            self.number = _grown(self.number, capacity, rows, np.nan)
        if self.code is not None:
            self.code = _grown(self.code, capacity, rows, -1)

    def set(self, row: int, value: Any) -> None:
        if value is None:
            self.kind[row] = NULL
        elif value is True or value is False:
            self.kind[row] = TRUE if value else FALSE
        elif isinstance(value, (int, float)):
            if self.number is None:
                self.number = np.full(len(self.kind), np.nan)
            self.kind[row] = NUMBER
            self.number[row] = float(value)
        elif isinstance(value, str):
            if self.code is None:
                self.code = np.full(len(self.kind), -1, dtype=np.int32)
            code = self.vocab.get(value)
            if code is None:
                code = self.vocab[value] = len(self.vocab)
                moment = instant(value)
                self.instants.append(np.nan if moment is None else moment)
            self.kind[row] = STRING
            self.code[row] = code
        else:
            self.kind[row] = OTHER

    def take(self, rows: np.ndarray) -> "Column":
        out = Column(0)
        out.kind = self.kind[rows]
        out.number = None if self.number is None else self.number[rows]
        out.code = None if self.code is None else self.code[rows]
        out.vocab, out.instants = self.vocab, self.instants  # stale entries are harmless; vocab only grows
        return out


def _grown(array: np.ndarray, capacity: int, rows: int, fill: Any) -> np.ndarray:
    if len(array) >= capacity:
        return array
    out = np.full(capacity, fill, dtype=array.dtype)
    out[:rows] = array[:rows]
    return out


class PayloadIndex:
    def __init__(self) -> None:
        self.columns: dict[str, Column] = {}
        self.rows = 0
        self.capacity = 0

    def append(self, payloads: list[Any] | None, n: int) -> None:
        """The payloads of `n` new rows (a dict or None each, as `parsed` gives them; None: none has one)."""
        start = self.rows
        self._reserve(start + n)
        if payloads is not None:
            for i, payload in enumerate(payloads):
                if not isinstance(payload, dict):
                    continue
                for key, value in payload.items():
                    column = self.columns.get(key)
                    if column is None:
                        column = self.columns[key] = Column(self.capacity)
                    column.set(start + i, value)
        self.rows = start + n

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        self.capacity = max(need, int(self.capacity * 1.5), 1024)
        for column in self.columns.values():
            column.grow(self.capacity, self.rows)

    def take(self, rows: np.ndarray) -> "PayloadIndex":
        """A new index holding `rows` of this one, in that order (a compaction)."""
        out = PayloadIndex()
        out.columns = {key: column.take(rows) for key, column in self.columns.items()}
        out.rows = out.capacity = len(rows)
        return out

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluate(self, node: Node, n_rows: int) -> np.ndarray:
        """The rows 0..n_rows-1 a filter matches, as a bool mask (dead rows included: the caller masks them)."""
        if isinstance(node, And):
            mask = self.evaluate(node.items[0], n_rows)
            for item in node.items[1:]:
                mask &= self.evaluate(item, n_rows)
            return mask
        if isinstance(node, Or):
            mask = self.evaluate(node.items[0], n_rows)
            for item in node.items[1:]:
                mask |= self.evaluate(item, n_rows)
            return mask
        if isinstance(node, Not):
            return ~self.evaluate(node.item, n_rows)
        return self._condition(node, n_rows)

    def _condition(self, cond: Cond, n: int) -> np.ndarray:
        column = self.columns.get(cond.field)
        if column is None:  # no row has the key: nothing matches (and $exists is False)
            return np.zeros(n, dtype=bool)
        kind = column.kind[:n]
        if cond.op == "exists":
            return kind != ABSENT
        if cond.op in _COMPARE:
            what, bound = cond.value
            if what == "number":
                if column.number is None:
                    return np.zeros(n, dtype=bool)
                with np.errstate(invalid="ignore"):
                    return _COMPARE[cond.op](column.number[:n], bound)  # NaN (not a number) compares False
            if column.code is None or not column.instants:
                return np.zeros(n, dtype=bool)
            instants = np.append(np.asarray(column.instants, dtype=np.float64), np.nan)  # code -1 -> NaN
            with np.errstate(invalid="ignore"):
                return _COMPARE[cond.op](instants[column.code[:n]], bound)
        values = (cond.value,) if cond.op == "eq" else cond.value
        mask = np.zeros(n, dtype=bool)
        numbers = [v for v in values if isinstance(v, float)]
        if numbers and column.number is not None:
            mask |= np.isin(column.number[:n], numbers) & (kind == NUMBER)
        codes = [column.vocab[v] for v in values if isinstance(v, str) and v in column.vocab]
        if codes and column.code is not None:
            mask |= np.isin(column.code[:n], codes)
        for v in values:
            if v is None or isinstance(v, bool):
                mask |= kind == (NULL if v is None else TRUE if v else FALSE)
        return mask

    # -- reports and snapshots -------------------------------------------------------------------------
    def describe(self, alive: np.ndarray) -> dict[str, dict[str, int]]:
        """Per key, how many live rows hold each kind of value."""
        out = {}
        for key, column in sorted(self.columns.items()):
            counts = np.bincount(column.kind[: len(alive)][alive], minlength=len(KIND_NAMES))
            out[key] = {name: int(c) for name, c in zip(KIND_NAMES, counts) if name != "absent" and c}
        return out

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able meta, arrays) for a snapshot."""
        meta: dict[str, Any] = {"rows": self.rows, "columns": []}
        arrays: dict[str, np.ndarray] = {}
        for i, (key, column) in enumerate(self.columns.items()):
            vocab = sorted(column.vocab, key=column.vocab.__getitem__)
            meta["columns"].append({"key": key, "vocab": vocab})
            arrays[f"payload{i}.kind"] = column.kind[: self.rows]
            if column.number is not None:
                arrays[f"payload{i}.number"] = column.number[: self.rows]
            if column.code is not None:
                arrays[f"payload{i}.code"] = column.code[: self.rows]
        return meta, arrays

    @classmethod
    def restore(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> "PayloadIndex":
        out = cls()
        out.rows = out.capacity = int(meta["rows"])
        for i, entry in enumerate(meta["columns"]):
            column = Column(0)
            column.kind = np.array(arrays[f"payload{i}.kind"], dtype=np.uint8)
            if f"payload{i}.number" in arrays:
                column.number = np.array(arrays[f"payload{i}.number"], dtype=np.float64)
            if f"payload{i}.code" in arrays:
                column.code = np.array(arrays[f"payload{i}.code"], dtype=np.int32)
            column.vocab = {v: c for c, v in enumerate(entry["vocab"])}
            column.instants = [np.nan if (m := instant(v)) is None else m for v in entry["vocab"]]
            if len(column.kind) != out.rows:
                raise ValueError(f"payload column {entry['key']!r} has {len(column.kind)} rows, not {out.rows}")
            out.columns[entry["key"]] = column
        return out


def parsed(payloads: list[Any] | str | bytes | None, n: int) -> list[Any] | None:
    """Change-log payloads as dicts (JSON text parsed once, outside any lock): a JSON array of them, or a list
    with JSON text or a dict per row."""
    if isinstance(payloads, (bytes, str)):  # a change-log read: one JSON array
        payloads = orjson.loads(payloads)
    if payloads is None:
        return None
    if len(payloads) != n:
        raise ValueError(f"{len(payloads)} payloads for {n} rows")
    return [orjson.loads(p) if isinstance(p, (bytes, str)) else p for p in payloads]
