"""refuse_excess_keys (issue 34, item 2): a JSON upsert body's payload keys counted by simdjson without building
them, against orjson's full parse as the oracle, on bodies made to fool a byte scan (keys and colons inside
strings, escaped quotes, nesting, whitespace)."""

from __future__ import annotations

import random

import orjson
import pytest

from indexes.errors import InvalidInput
from indexes.vectors import refuse_excess_keys

TRICKY_KEYS = ['a', 'b:c', 'd"e', 'f\\\\', 'g\\"h', '{i}', '[j]', 'k\\\\"', ' l ', 'm\u00e9', 'n\u0001']


def random_value(rng: random.Random, depth: int) -> object:
    roll = rng.random()
    if depth > 2 or roll < 0.4:
        return rng.choice([1, -2.5, None, True, "x:y", '"{"', "\\", "]:[", "é"])
    if roll < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(TRICKY_KEYS) + str(rng.randint(0, 9)): random_value(rng, depth + 1) for _ in range(3)}


def random_payload(rng: random.Random) -> dict | None:
    if rng.random() < 0.1:
        return None
    return {rng.choice(TRICKY_KEYS) + str(rng.randint(0, 30)): random_value(rng, 0) for _ in range(rng.randint(0, 12))}


def oracle(payloads: list, max_keys: int) -> str | None:
    """The field the refusal names, from the fully built payloads; None when nothing is refused."""
    keys: set[str] = set()
    for i, p in enumerate(payloads):
        if isinstance(p, dict):
            if len(p) > max_keys:
                return f"payloads[{i}]"
            keys.update(p)
            if len(keys) > max_keys:
                return "payloads"
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_count_matches_a_full_parse(seed):
    rng = random.Random(seed)
    payloads = [random_payload(rng) for _ in range(rng.randint(1, 8))]
    max_keys = rng.randint(1, 12)
    body = orjson.dumps({"ids": list(range(len(payloads))), "vectors": [[1.0]] * len(payloads), "payloads": payloads})
    if seed % 2:  # the same body as a person would indent it
        body = orjson.dumps(orjson.loads(body), option=orjson.OPT_INDENT_2)
    expected = oracle(payloads, max_keys)
    if expected is None:
        refuse_excess_keys(body, max_keys)
    else:
        with pytest.raises(InvalidInput) as refused:
            refuse_excess_keys(body, max_keys)
        assert refused.value.field == expected


def test_colons_in_values_and_nested_keys_are_not_top_level_keys():
    payload = {"doc": {f"inner{i}": f"t:{i}" for i in range(500)}, "url": "http://a:b@c:80/" * 50}
    refuse_excess_keys(orjson.dumps({"ids": [1], "vectors": [[1.0]], "payloads": [payload]}), 2)
    with pytest.raises(InvalidInput):
        refuse_excess_keys(orjson.dumps({"ids": [1], "vectors": [[1.0]], "payloads": [payload]}), 1)


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'{"payloads": 3}', b'{"payloads": [1, "a", null]}',
                                  b'{"payloads": [{"a": 1}]} trailing', b'\xff\xfe'])
def test_what_does_not_parse_or_has_no_payloads_is_left_to_the_full_parse(body):
    refuse_excess_keys(body, 0)
