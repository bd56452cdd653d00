"""Numbers in request bodies as JSON means them: pydantic's lax mode reads `true`/`false` as 1/0 and `"3"` as 3
for int and float fields, which the schema (and a careful client) calls a type error. These refuse booleans and
strings, and an integer field still takes 2.0, as JSON Schema's "integer" does."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, StrictFloat


def _number_only(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, str):
        raise ValueError("a string is not a number")
    return value


def _number_items_only(value: Any) -> Any:
    if isinstance(value, list) and any(isinstance(item, (bool, str)) for item in value):
        raise ValueError("every item must be a number (not a boolean or a string)")
    return value


NUMBER_ONLY = BeforeValidator(_number_only)
Int = Annotated[int, NUMBER_ONLY]
# A bounded optional integer: Annotated[int, Field(ge=.., le=..), NUMBER_ONLY] | None, bounds before the validator.
# (`Int | None = Field(ge=..)`, or the bounds after it, reach the JSON schema as "ge"/"le", no JSON Schema keywords.)
IntList = Annotated[list[int], BeforeValidator(_number_items_only)]  # one check per list: ids lists are long
Float = StrictFloat  # strict float takes ints, and no booleans or strings
Number = Annotated[int | float, NUMBER_ONLY]  # search parameters: an integer stays one
DECIMAL = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # as JSON writes numbers (a leading dot allowed)


def decimal(text: str) -> float:
    """A number written as text in a query string or a header, or NaN where it is not decimal: Python's float()
    would also read "1_0" as 10, " 5", "nan", "inf" and "infinity"."""
    return float(text) if DECIMAL.fullmatch(text) else math.nan


# json_schema_extra of an id list the service refuses duplicates in (indexes/vectors.check_ids, spatial ids)
UNIQUE_ITEMS: dict[str, Any] = {"uniqueItems": True}
