"""olap/manager.py: what the manager itself answers around the engines."""

from __future__ import annotations

import asyncio

import pytest

from olap.manager import OlapManager


def test_a_query_given_up_past_its_limit_says_so():
    """The manager's own guard, a second past the engines' limit (a query that waited for the engine's thread, or
    an answer still being converted), answered 422 query-timeout with an empty detail."""
    async def stuck(*args):
        await asyncio.sleep(30)

    manager = object.__new__(OlapManager)
    manager._run = stuck  # type: ignore[method-assign]
    with pytest.raises(TimeoutError, match=r"past its 0.2 s limit \(timeout_s\)"):
        asyncio.run(manager._run_within(0.2, "duckdb", "run_sql", "SELECT 1"))
