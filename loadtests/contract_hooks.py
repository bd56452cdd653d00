"""schemathesis hooks for loadtests/contract.py (loaded through SCHEMATHESIS_HOOKS): a generated spatial join may
name the layers contract.seed made, so that fuzzing reaches the join engines and their paging instead of a 404.
A layer name is a free string in the schema, which cannot tie it to a resource; each generated body is drawn
either as generated or with the seeded names in place of its generated ones, so the 404 of an unknown layer is
still exercised."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

SEEDED_LAYERS = {
    "/v1/spatial/joins/point-in-polygon": {"points": "pts", "polygons": "polys"},
    "/v1/spatial/joins/within-distance": {"left": "pts", "right": "pts"},
}


@schemathesis.hook
def flatmap_body(ctx: Any, body: Any) -> st.SearchStrategy:
    names = SEEDED_LAYERS.get(ctx.operation.path) if ctx.operation is not None else None
    if not names or not isinstance(body, dict):
        return st.just(body)
    # Only a name generated as a string is replaced: a negative case's wrong type (null, an object) stays wrong.
    seeded = {key: name for key, name in names.items() if isinstance(body.get(key), str)}
    return st.sampled_from([{**body, **seeded}, body]) if seeded else st.just(body)
