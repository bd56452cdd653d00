"""The resident payload index: the values of each top-level payload key, row for row with a resident collection,
evaluated to a row mask in memory (no PostgreSQL round trip per filtered search).

Every key seen becomes a sparse column (inferred, and reported by `describe`), holding entries only for the rows
that have the key, so memory follows the payloads actually stored, never keys x collection size (one point with
many keys on a large collection once took 13 bytes per key per row):
- `rows`: int64 row numbers, ascending (rows only append; a compaction keeps their order);
- `kind`: uint8 per entry, what the value is (null, false, true, number, string, other);
- `number`: float64 per entry, allocated once a number is seen (NaN elsewhere);
- `code`: int32 per entry into the key's string vocabulary, allocated once a string is seen (-1 elsewhere).
  Each vocabulary entry also has its instant (filters.instant, NaN for non-dates), so date ranges cost a gather.
An entry costs 8 + 1 + 8 + 4 bytes at most, arrays at most double the entries they hold. How many keys a
collection may have is bounded where writes are committed (store.py, SWITCHYARD_MAX_PAYLOAD_KEYS).
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
    """One key's entries: `size` of them, in the first `size` places of each array."""

    def __init__(self) -> None:
        self.size = 0
        self.rows = np.empty(0, dtype=np.int64)
        self.kind = np.empty(0, dtype=np.uint8)
        self.number: np.ndarray | None = None
        self.code: np.ndarray | None = None
        self.vocab: dict[str, int] = {}
        self.instants: list[float] = []

    def extend(self, rows: list[int], values: list[Any]) -> None:
        """Entries for new rows (ascending, after every row held)."""
        start, end = self.size, self.size + len(rows)
        if end > len(self.rows):  # grown by doubling: amortised O(1) an entry, at most twice what is held
            capacity = max(end, 2 * len(self.rows), 4)
            self.rows = _grown(self.rows, capacity, start, 0)
            self.kind = _grown(self.kind, capacity, start, ABSENT)
            if self.number is not None:
                self.number = _grown(self.number, capacity, start, np.nan)
            if self.code is not None:
                self.code = _grown(self.code, capacity, start, -1)
        self.rows[start:end] = rows
        for i, value in enumerate(values, start):
            self._set(i, value)
        self.size = end

    def _set(self, i: int, value: Any) -> None:
        if value is None:
            self.kind[i] = NULL
        elif value is True or value is False:
            self.kind[i] = TRUE if value else FALSE
        elif isinstance(value, (int, float)):
            if self.number is None:
                self.number = np.full(len(self.kind), np.nan)
            self.kind[i] = NUMBER
            self.number[i] = float(value)
        elif isinstance(value, str):
            if self.code is None:
                self.code = np.full(len(self.kind), -1, dtype=np.int32)
            code = self.vocab.get(value)
            if code is None:
                code = self.vocab[value] = len(self.vocab)
                moment = instant(value)
                self.instants.append(np.nan if moment is None else moment)
            self.kind[i] = STRING
            self.code[i] = code
        else:
            self.kind[i] = OTHER

    def below(self, n: int) -> int:
        """How many entries are for rows 0..n-1."""
        return int(np.searchsorted(self.rows[: self.size], n))

    def take(self, position: np.ndarray) -> "Column":
        """This column over new row numbers: `position[old row]`, -1 for rows not kept (a compaction)."""
        new = position[self.rows[: self.size]]
        keep = np.flatnonzero(new >= 0)
        new = new[keep]
        if len(new) > 1 and (np.diff(new) < 0).any():  # a reordering compaction: entries follow their rows
            order = np.argsort(new, kind="stable")
            keep, new = keep[order], new[order]
        out = Column()
        out.size = len(keep)
        out.rows = new
        out.kind = self.kind[keep]
        out.number = None if self.number is None else self.number[keep]
        out.code = None if self.code is None else self.code[keep]
        out.vocab, out.instants = self.vocab, self.instants  # stale entries are harmless; vocab only grows
        return out

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.rows, self.kind, self.number, self.code) if a is not None)


def _grown(array: np.ndarray, capacity: int, held: int, fill: Any) -> np.ndarray:
    out = np.full(capacity, fill, dtype=array.dtype)
    out[:held] = array[:held]
    return out


class PayloadIndex:
    def __init__(self) -> None:
        self.columns: dict[str, Column] = {}
        self.rows = 0

    def append(self, payloads: list[Any] | None, n: int) -> None:
        """The payloads of `n` new rows (a dict or None each, as `parsed` gives them; None: none has one)."""
        start = self.rows
        if payloads is not None:
            entries: dict[str, tuple[list[int], list[Any]]] = {}
            for i, payload in enumerate(payloads):
                if not isinstance(payload, dict):
                    continue
                for key, value in payload.items():
                    found = entries.get(key)
                    if found is None:
                        found = entries[key] = ([], [])
                    found[0].append(start + i)
                    found[1].append(value)
            for key, (rows, values) in entries.items():
                column = self.columns.get(key)
                if column is None:
                    column = self.columns[key] = Column()
                column.extend(rows, values)
        self.rows = start + n

    def take(self, rows: np.ndarray) -> "PayloadIndex":
        """A new index holding `rows` of this one, in that order (a compaction)."""
        position = np.full(self.rows, -1, dtype=np.int64)
        position[rows] = np.arange(len(rows))
        out = PayloadIndex()
        out.columns = {key: column.take(position) for key, column in self.columns.items()}
        out.rows = len(rows)
        return out

    def nbytes(self) -> int:
        """The bytes its arrays hold (vocabularies aside)."""
        return sum(column.nbytes() for column in self.columns.values())

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
        column = self.columns.get(node.field)
        if column is None:  # no row has the key: nothing matches (and $exists is False)
            return np.zeros(n_rows, dtype=bool)
        m = column.below(n_rows)
        matched = _matches(column, node, m)
        if matched is None:
            return np.zeros(n_rows, dtype=bool)
        if m == n_rows:  # every row has the key (rows ascend, below n_rows): the entries are the rows
            return matched
        mask = np.zeros(n_rows, dtype=bool)
        mask[column.rows[:m][matched]] = True
        return mask

    # -- reports and snapshots -------------------------------------------------------------------------
    def describe(self, alive: np.ndarray) -> dict[str, dict[str, int]]:
        """Per key, how many live rows hold each kind of value."""
        out = {}
        for key, column in sorted(self.columns.items()):
            m = column.below(len(alive))
            counts = np.bincount(column.kind[:m][alive[column.rows[:m]]], minlength=len(KIND_NAMES))
            out[key] = {name: int(c) for name, c in zip(KIND_NAMES, counts) if name != "absent" and c}
        return out

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able meta, arrays) for a snapshot."""
        meta: dict[str, Any] = {"rows": self.rows, "columns": []}
        arrays: dict[str, np.ndarray] = {}
        for i, (key, column) in enumerate(self.columns.items()):
            vocab = sorted(column.vocab, key=column.vocab.__getitem__)
            meta["columns"].append({"key": key, "vocab": vocab})
            arrays[f"payload{i}.rows"] = column.rows[: column.size]
            arrays[f"payload{i}.kind"] = column.kind[: column.size]
            if column.number is not None:
                arrays[f"payload{i}.number"] = column.number[: column.size]
            if column.code is not None:
                arrays[f"payload{i}.code"] = column.code[: column.size]
        return meta, arrays

    @classmethod
    def restore(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> "PayloadIndex":
        out = cls()
        out.rows = int(meta["rows"])
        for i, entry in enumerate(meta["columns"]):
            column = Column()
            column.rows = np.array(arrays[f"payload{i}.rows"], dtype=np.int64)
            column.kind = np.array(arrays[f"payload{i}.kind"], dtype=np.uint8)
            column.size = len(column.rows)
            if f"payload{i}.number" in arrays:
                column.number = np.array(arrays[f"payload{i}.number"], dtype=np.float64)
            if f"payload{i}.code" in arrays:
                column.code = np.array(arrays[f"payload{i}.code"], dtype=np.int32)
            column.vocab = {v: c for c, v in enumerate(entry["vocab"])}
            column.instants = [np.nan if (m := instant(v)) is None else m for v in entry["vocab"]]
            rows = column.rows
            sizes = {len(a) for a in (column.kind, column.number, column.code) if a is not None}
            if sizes != {column.size} or (column.size and (rows[0] < 0 or rows[-1] >= out.rows
                                                          or (np.diff(rows) <= 0).any())):
                raise ValueError(f"payload column {entry['key']!r} does not fit {out.rows} rows")
            out.columns[entry["key"]] = column
        return out


def _matches(column: Column, cond: Cond, m: int) -> np.ndarray | None:
    """Which of a column's first `m` entries meet a condition (a bool array, or None for none)."""
    kind = column.kind[:m]
    if cond.op == "exists":
        return kind != ABSENT
    if cond.op in _COMPARE:
        what, bound = cond.value
        if what == "number":
            if column.number is None:
                return None
            with np.errstate(invalid="ignore"):
                return _COMPARE[cond.op](column.number[:m], bound)  # NaN (not a number) compares False
        if column.code is None or not column.instants:
            return None
        instants = np.append(np.asarray(column.instants, dtype=np.float64), np.nan)  # code -1 -> NaN
        with np.errstate(invalid="ignore"):
            return _COMPARE[cond.op](instants[column.code[:m]], bound)
    values = (cond.value,) if cond.op == "eq" else cond.value
    matched = np.zeros(m, dtype=bool)
    numbers = [v for v in values if isinstance(v, float)]
    if numbers and column.number is not None:
        matched |= np.isin(column.number[:m], numbers) & (kind == NUMBER)
    codes = [column.vocab[v] for v in values if isinstance(v, str) and v in column.vocab]
    if codes and column.code is not None:
        matched |= np.isin(column.code[:m], codes)
    for v in values:
        if v is None or isinstance(v, bool):
            matched |= kind == (NULL if v is None else TRUE if v else FALSE)
    return matched


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
