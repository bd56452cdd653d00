"""The OLAP domain's client errors: what the request itself got wrong, as opposed to an engine failing.

Every class here is answered 4xx (service/errors.py) and never counted against an engine by the circuit breaker
(olap/manager.py): a client that sends bad SQL, a query whose result no answer can hold, or SQL the guard refuses
must not be able to put an engine into cool-down for everyone else.
"""

from __future__ import annotations


class ClientError(ValueError):
    """The request's own fault; `field` names the request field to blame."""

    field = "sql"


class QueryFailed(ClientError):
    """The engine refused the statement as written (unknown column, type error, division by zero...)."""


class UnrepresentableResult(QueryFailed):
    """The engine computed a value the answer cannot hold (a date past year 9999 or before year 1, ...)."""

    def __init__(self, engine: str, reason: object) -> None:
        super().__init__(f"{engine}: the result cannot be represented: a value is outside the range of its type in "
                         f"the answer (dates and timestamps run from year 1 to 9999): {reason}")
