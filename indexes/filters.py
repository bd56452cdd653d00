"""The payload filter language: parsed and checked once, then evaluated by the resident payload index
(indexes/payloads.py) or translated to SQL over jsonb for pgvector, with the same meaning on both.

MongoDB's syntax, as Chroma and Pinecone use it, over top-level payload keys: {"color": "red"},
{"price": {"$gte": 10, "$lt": 20}}, $eq $ne $in $nin $gt $gte $lt $lte $exists, $and / $or / $not. Values match
values of the operand's type (numbers as float64, strings exactly, ISO-8601 dates as instants); `$ne` / `$nin`
match points without the key. A bad filter is an InvalidInput naming the path inside it, e.g.
`filter.$or[1].price.$gte`. The full rules: docs/api.md#filtered-search.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Union

import orjson

from .errors import InvalidInput

MAX_DEPTH = 8  # nested $and / $or / $not
MAX_CONDITIONS = 64  # field conditions in one filter
MAX_IN = 1024  # values in one $in / $nin
MAX_FIELD_CHARS = 128

RANGE_OPS = ("$gt", "$gte", "$lt", "$lte")
FIELD_OPS = ("$eq", "$ne", "$in", "$nin", "$exists", *RANGE_OPS)
LOGICAL_OPS = ("$and", "$or", "$not")

# The date strings both sides read as instants. Strict on purpose: PostgreSQL and Python must agree on exactly
# which strings are dates (switchyard_instant in migrations/0007 uses the same pattern).
DATE_PATTERN = (r"^[1-9][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
                r"([T ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?"
                r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?$")
_DATE = re.compile(DATE_PATTERN)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

Scalar = Union[str, float, bool, None]


@dataclass(frozen=True)
class Cond:
    """One field condition. op: eq (value a Scalar), in (a tuple of Scalars), exists (a bool), or a range op
    gt/gte/lt/lte with value ("number", x) or ("date", epoch seconds)."""

    field: str
    op: str
    value: Any


@dataclass(frozen=True)
class And:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Or:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Not:
    item: "Node"


Node = Union[Cond, And, Or, Not]


def instant(text: str) -> float | None:
    """Epoch seconds of an ISO-8601 date or date-time string (UTC when it has no offset), or None when it is not
    one. Microseconds are exact integers divided once, as PostgreSQL's extract(epoch ...)::float8 rounds."""
    if not _DATE.match(text):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:  # matches the pattern but is no date (2023-02-30)
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return ((moment - _EPOCH) // timedelta(microseconds=1)) / 10**6


PARSED_ENTRIES = 1024  # filters remembered by their JSON text (a client sends the same one with many searches)
PARSED_TEXT_BYTES = 4096  # ... when their text is at most this long: caches hold entries, not megabytes of filters
# Longer filters: the most recent ones, up to this much text in all. One request parses its filter more than once
# (where it is read, and where it is searched), and a long $in costs far more to parse than to look up.
RECENT_LARGE_BYTES = 2**20
KEY_CHARS = 256  # a longer filter is keyed by a digest, so no cache keeps the filter itself
_parsed: dict[bytes, Node] = {}
_recent_large: OrderedDict[bytes, Node] = OrderedDict()


def parse(raw: Any, path: str = "filter") -> Node | None:
    """A checked filter tree, or None for no filter (None or {}). A filter seen recently is not parsed again: the
    same JSON text gives the same (immutable) tree, and so the same key(). Refused filters are not remembered."""
    if raw is None or raw == {}:
        return None
    try:
        text: bytes | None = orjson.dumps(raw)  # 1, 1.0 and true stay apart, as they must
    except TypeError:  # not JSON (a Python caller's own objects): parsed every time
        text = None
    if text is None:
        return _object(raw, path, 0, [0])
    small = len(text) <= PARSED_TEXT_BYTES
    node = _parsed.get(text) if small else _recent_large.get(text)
    if node is not None:
        return node
    node = _object(raw, path, 0, [0])
    if small:
        if len(_parsed) >= PARSED_ENTRIES:
            _parsed.clear()
        _parsed[text] = node
    elif len(text) <= RECENT_LARGE_BYTES:
        # Its key from its text, which is shorter to digest than its repr; the same text, the same meaning.
        object.__setattr__(node, "_key", "json:" + _digest(text))
        _remember_large(text, node)
    return node


def _remember_large(text: bytes, node: Node) -> None:
    """Keeps `node` among the recent large filters, forgetting the oldest past RECENT_LARGE_BYTES of text."""
    _recent_large[text] = node
    held = sum(map(len, _recent_large))
    while held > RECENT_LARGE_BYTES and _recent_large:
        try:
            held -= len(_recent_large.popitem(last=False)[0])
        except KeyError:  # another thread emptied it first
            break


def portable(raw: Any) -> Any:
    """A checked filter (parse) with its integers beyond 64 bits as floats, which is what any number means here,
    so that it crosses process links (msgspec) and JSON; the same object when it has none."""
    try:
        orjson.dumps(raw)
        return raw
    except TypeError:
        return _floats(raw)


def _floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    return value


def key(node: Node) -> str:
    """What identifies a filter's meaning in caches: its repr, not the tree (True == 1.0 in Python, but
    {"f": true} is no {"f": 1}), or past KEY_CHARS a 128-bit digest of it (of its JSON text, for a large filter
    parse() remembered); computed once per tree."""
    found = node.__dict__.get("_key")
    if found is None:
        found = repr(node)
        if len(found) > KEY_CHARS:
            found = "repr:" + _digest(found.encode())
        object.__setattr__(node, "_key", found)  # frozen, and not a field: equality and hashing ignore it
    return found


def _digest(data: bytes) -> str:
    """128 bits of SHA-256 (which CPUs compute in hardware: twice as fast as BLAKE2 here) as hex."""
    return hashlib.sha256(data).hexdigest()[:32]


def _object(raw: Any, path: str, depth: int, counter: list[int]) -> Node:
    if not isinstance(raw, dict) or not raw:
        raise InvalidInput("a filter must be a non-empty JSON object", field=path)
    if depth > MAX_DEPTH:
        raise InvalidInput(f"nests deeper than {MAX_DEPTH} levels", field=path)
    items: list[Node] = []
    for key, value in raw.items():
        here = f"{path}.{key}"
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise InvalidInput(f"{key} takes a non-empty list of filters", field=here)
            parts = tuple(_object(v, f"{here}[{i}]", depth + 1, counter) for i, v in enumerate(value))
            items.append(parts[0] if len(parts) == 1 else And(parts) if key == "$and" else Or(parts))
        elif key == "$not":
            items.append(Not(_object(value, here, depth + 1, counter)))
        elif key.startswith("$"):
            raise InvalidInput(f"unknown operator {key!r}; logical operators: {', '.join(LOGICAL_OPS)}", field=here)
        else:
            if len(key) > MAX_FIELD_CHARS:
                raise InvalidInput(f"field names have at most {MAX_FIELD_CHARS} characters", field=path)
            _text(key, path)
            items.append(_field(key, value, here, counter))
    return items[0] if len(items) == 1 else And(tuple(items))


def _field(name: str, raw: Any, path: str, counter: list[int]) -> Node:
    if not isinstance(raw, dict):
        return _count(Cond(name, "eq", _scalar(raw, path)), counter, path)
    if not raw:
        raise InvalidInput("give a value or at least one operator", field=path)
    items: list[Node] = []
    for op, value in raw.items():
        here = f"{path}.{op}"
        if op not in FIELD_OPS:
            raise InvalidInput(f"unknown operator {op!r}; field operators: {', '.join(FIELD_OPS)}", field=here)
        if op in ("$eq", "$ne"):
            node: Node = Cond(name, "eq", _scalar(value, here))
        elif op in ("$in", "$nin"):
            if not isinstance(value, list):
                raise InvalidInput(f"{op} takes a list of values", field=here)
            if len(value) > MAX_IN:
                raise InvalidInput(f"{op} takes at most {MAX_IN} values", field=here)
            node = Cond(name, "in", _values(value, here))
        elif op == "$exists":
            if not isinstance(value, bool):
                raise InvalidInput("$exists takes true or false", field=here)
            node = Cond(name, "exists", True)
        else:
            node = Cond(name, op[1:], _bound(value, here))
        negated = op in ("$ne", "$nin") or (op == "$exists" and value is False)
        items.append(_count(Not(node) if negated else node, counter, here))
    return items[0] if len(items) == 1 else And(tuple(items))


def _values(values: list[Any], path: str) -> tuple[Scalar, ...]:
    """The distinct scalars of an $in / $nin list. A list of strings alone (the common long one) is checked in
    one pass over its joined text; anything else value by value, each named by its index where it is refused."""
    if all(type(v) is str for v in values) and "\x00" not in "".join(values):
        return tuple(dict.fromkeys(values))
    scalars = (_scalar(v, f"{path}[{i}]") for i, v in enumerate(values))
    return tuple({(type(v), v): v for v in scalars}.values())  # by type too: true == 1.0 in Python, not here


def _count(node: Node, counter: list[int], path: str) -> Node:
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise InvalidInput(f"a filter holds at most {MAX_CONDITIONS} field conditions", field=path)
    return node


def _scalar(value: Any, path: str) -> Scalar:
    if isinstance(value, str):
        _text(value, path)
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer of 309 digits or more
            raise InvalidInput("must be a number within the float64 range (about +-1.8e308)", field=path) from None
        if not math.isfinite(number):
            raise InvalidInput("must be a finite number", field=path)
        return number
    raise InvalidInput("must be a string, a number, a boolean or null", field=path)


def _text(value: str, path: str) -> None:
    """Strings go to PostgreSQL as text on pgvector's path, which cannot hold NUL: refused on every engine."""
    if "\x00" in value:
        raise InvalidInput("must not contain a NUL character (\\u0000)", field=path)


def _bound(value: Any, path: str) -> tuple[str, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("number", _scalar(value, path))  # type: ignore[return-value]
    if isinstance(value, str):
        moment = instant(value)
        if moment is not None:
            return ("date", moment)
    raise InvalidInput("a range bound must be a number or an ISO-8601 date such as 2024-05-01 or "
                       "2024-05-01T12:00:00Z", field=path)


# -- SQL over jsonb (pgvector) -------------------------------------------------------------------------------
_SQL_OPS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
_NUMBER = "CASE WHEN jsonb_typeof(payload -> {f}) = 'number' THEN (payload ->> {f})::float8 END"


def to_sql(node: Node, args: list[Any]) -> str:
    """A boolean SQL expression over the `payload` jsonb column; bound values are appended to `args` (so
    placeholders continue after the caller's). Every condition is coalesced: NULL never leaks into NOT."""
    if isinstance(node, And):
        return "(" + " AND ".join(to_sql(n, args) for n in node.items) + ")"
    if isinstance(node, Or):
        return "(" + " OR ".join(to_sql(n, args) for n in node.items) + ")"
    if isinstance(node, Not):
        return f"(NOT {to_sql(node.item, args)})"
    if node.op == "eq" and not isinstance(node.value, float):  # containment: the GIN index on payload serves it
        return f"coalesce(payload @> {_arg(args, orjson.dumps({node.field: node.value}).decode())}::jsonb, false)"
    f = _arg(args, node.field) + "::text"
    if node.op == "exists":
        return f"coalesce(payload ? {f}, false)"
    if node.op in _SQL_OPS:
        kind, bound = node.value
        value = _NUMBER.format(f=f) if kind == "number" else f"switchyard_instant(payload -> {f})"
        return f"coalesce({value} {_SQL_OPS[node.op]} {_arg(args, bound)}::float8, false)"
    values = (node.value,) if node.op == "eq" else node.value
    numbers = [v for v in values if isinstance(v, float)]
    strings = [v for v in values if isinstance(v, str)]
    others = [v for v in values if v is None or isinstance(v, bool)]  # null, true, false: jsonb equality
    parts = []
    if numbers:
        parts.append(f"({_NUMBER.format(f=f)}) = ANY({_arg(args, numbers)}::float8[])")
    if strings:
        parts.append(f"(jsonb_typeof(payload -> {f}) = 'string' "
                     f"AND payload ->> {f} = ANY({_arg(args, strings)}::text[]))")
    if others:
        literals = ["null" if v is None else "true" if v else "false" for v in others]
        parts.append(f"payload -> {f} = ANY({_arg(args, literals)}::jsonb[])")
    if not parts:  # $in []
        return "false"
    return "coalesce(" + " OR ".join(parts) + ", false)"


def _arg(args: list[Any], value: Any) -> str:
    args.append(value)
    return f"${len(args)}"
