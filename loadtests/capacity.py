"""How many closed-loop users a Switchyard engine admits: the default sweeps stay within it, so that a default run
measures the engine, not its refusals (issue 37).

Admission control (service/admission/control.py) gives each engine a gate: `engine_limits` requests run at once,
`SWITCHYARD_QUEUE_DEPTH` more wait (default twice the limit), and the next one is refused with 503 at once. A
closed-loop user refused at once comes straight back, so a sweep point above limit + queue is mostly refusals
(pgvector at its defaults: 5 running + 10 queued, 15 users; 16 shed 25-46% of their requests). The figures come
from the same settings the service reads, with the environment the runner gives the service it starts
(`--serve-env`), times its worker processes (each admits on its own); for a service given by `--url` the
defaults, in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

PREFIX = "SWITCHYARD_"

# The gates a workload's requests take, by its --engine (or a vectors target), as the service names its engines.
GATES: dict[str, dict[str, tuple[str, ...]]] = {
    "vectors": {"cpu": ("faiss",), "gpu": ("cuvs", "cupy"), "pgvector": ("pgvector",),
                "auto": ("faiss", "cuvs", "cupy")},
    "spatial": {"cpu": ("cpu-spatial",), "gpu": ("cuda-spatial",), "postgis": ("postgis",),
                "auto": ("cuda-spatial", "cpu-spatial")},
    "olap": {"cpu": ("duckdb",), "duckdb": ("duckdb",), "gpu": ("cudf",), "cudf": ("cudf",),
             "postgres": ("postgres",), "auto": ("duckdb", "cudf")},
}


def _settings(env: Mapping[str, str]) -> SimpleNamespace:
    """The groups of service.settings.Settings that admission reads, from SWITCHYARD_* variables in `env` only
    (not this process's environment: the service started here does not inherit it)."""
    from service.settings import FLAT, GROUPS

    values: dict[str, dict[str, str]] = {}
    for key, value in env.items():
        name = key[len(PREFIX):].lower() if key.upper().startswith(PREFIX) else ""
        if name in FLAT:
            group, field = FLAT[name]
            values.setdefault(group, {})[field] = value
    return SimpleNamespace(**{g: GROUPS[g](**values.get(g, {})) for g in ("database", "vectors", "admission")})


def admitted_users(gates: Iterable[str], env: Mapping[str, str] | None = None, processes: int = 1) -> int | None:
    """The most requests the service holds (running and queued) in every one of `gates` without refusing one, with
    the settings `env` gives it: its own Admission's gates; None where admission control is off or no gate is
    named."""
    from service.admission.control import Admission

    admission = Admission(_settings(env or {}))
    if not admission.enabled:
        return None
    caps = [(gate := admission.gate(g)).limit + gate.depth for g in gates]
    return min(caps) * max(1, processes) if caps else None


def within(users: list[int], cap: int | None) -> list[int]:
    """A default users sweep kept to what `cap` admits: the levels at or under it, and `cap` itself in place of
    the first level above it (so the sweep still ends at the most the engine admits)."""
    if cap is None:
        return list(users)
    kept = [u for u in users if u <= cap]
    return kept + [cap] if len(kept) < len(users) and cap not in kept else kept


def service_env(args: Any) -> tuple[dict[str, str], int]:
    """The settings environment and the worker processes of the service a run measures: the one it starts (its
    --serve-env, the benchmark environment), or for --url the defaults in one process."""
    from loadtests.processes import BENCHMARK_ENV

    if getattr(args, "url", None):
        return {}, 1
    env = {**BENCHMARK_ENV, **dict(e.split("=", 1) for e in getattr(args, "serve_env", []))}
    return env, int(getattr(args, "serve_workers", 1) or 1)


def engine_gates(domain: str, engine: str, available: set[str] | None = None) -> tuple[str, ...]:
    """The gates `engine` (a workload's --engine) takes; for auto, those of the engines the service has running."""
    gates = GATES[domain].get(engine, (engine,))
    if engine == "auto" and available:
        gates = tuple(g for g in gates if g in available) or gates
    return gates


def available_engines(api: Any) -> set[str] | None:
    """The engines the service reports available (GET /v1/engines); None where it does not say."""
    from loadtests.processes import ServiceError

    try:
        return {e["name"] for e in api.call("GET", "/v1/engines")["engines"] if e.get("available")}
    except (ServiceError, KeyError, TypeError):
        return None


def users_for(args: Any, domain: str, engine: str, api: Any) -> tuple[list[int], int | None]:
    """The users levels of a run's sweep, and what its engine admits: --users as given, else the workload's default
    levels kept within what the engine admits."""
    env, processes = service_env(args)
    cap = admitted_users(engine_gates(domain, engine, available_engines(api)), env, processes)
    return (args.users if args.users is not None else within(args.default_users, cap)), cap


def param_users(caps: Iterable[int | None], ceiling: int = 16) -> int:
    """The users of a vectors run's settings sweep, one figure for every target: `ceiling`, or where an engine under
    test admits fewer, the largest power of two it admits (pgvector at its defaults admits 15: 8)."""
    least = min([ceiling, *(c for c in caps if c is not None)])
    return 1 << (max(1, least).bit_length() - 1)
