"""Numbers in request bodies as JSON means them: pydantic's lax mode reads `true`/`false` as 1/0 for int and
float fields, which the schema (and a careful client) calls a type error. These refuse booleans, and an integer
field still takes 2.0, as JSON Schema's "integer" does."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, StrictFloat


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


def _no_bool_items(value: Any) -> Any:
    if isinstance(value, list) and any(isinstance(item, bool) for item in value):
        raise ValueError("a boolean is not a number")
    return value


NOT_BOOL = BeforeValidator(_not_bool)
Int = Annotated[int, NOT_BOOL]
# A bounded optional integer: Annotated[int, Field(ge=.., le=..), NOT_BOOL] | None, bounds before the validator.
# (`Int | None = Field(ge=..)`, or the bounds after it, reach the JSON schema as "ge"/"le", no JSON Schema keywords.)
IntList = Annotated[list[int], BeforeValidator(_no_bool_items)]  # one check per list: ids lists are long
Float = StrictFloat  # strict float takes ints, and no booleans
# json_schema_extra of an id list the service refuses duplicates in (indexes/vectors.check_ids, spatial ids)
UNIQUE_ITEMS: dict[str, Any] = {"uniqueItems": True}
