"""switchyard_client: the Python client of Switchyard.

    from switchyard_client import Client

    with Client("http://localhost:8000") as sy:
        sy.create_collection("docs", dim=3)
        sy.upsert("docs", [1, 2], [[1, 0, 0], [0, 1, 0]], payloads=[{"tag": "a"}, None])
        hits = sy.search("docs", [1, 0, 0], k=2)  # sees the upsert: read-your-writes
        hits.ids, hits.distances  # numpy arrays

docs/client.md has the rest.
"""

from ._driver import VERSION as __version__
from ._ops import JobFailed
from ._wire import RetryPolicy
from .aio import AsyncClient
from .client import Client
from .errors import (
                     Conflict,
                     DeadlineExceeded,
                     EngineUnavailable,
                     Forbidden,
                     InsufficientStorage,
                     InvalidRequest,
                     NotFound,
                     Overloaded,
                     PayloadTooLarge,
                     QueryFailed,
                     QuotaExceeded,
                     Retryable,
                     ServerError,
                     SwitchyardError,
                     TimedOut,
                     TransportError,
                     Unauthorized,
                     Unavailable,
)
from .results import Counts, Pairs, SearchResult, WriteResult

__all__ = ["AsyncClient", "Client", "Conflict", "Counts", "DeadlineExceeded", "EngineUnavailable", "Forbidden",
           "InsufficientStorage", "InvalidRequest", "JobFailed", "NotFound", "Overloaded", "Pairs",
           "PayloadTooLarge", "QueryFailed", "QuotaExceeded", "RetryPolicy", "Retryable", "SearchResult",
           "ServerError", "SwitchyardError", "TimedOut", "TransportError", "Unauthorized", "Unavailable", "WriteResult",
           "__version__"]
