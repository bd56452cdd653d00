"""Switchyard on a Ray cluster: vector shard hosts as Ray actors, the same FastAPI app as a Ray Serve ingress.

Ray is the optional `ray` extra; nothing imports this module unless SWITCHYARD_RAY_ADDRESS is set (or
`switchyard serve --ray` runs). Actors are named (in the namespace SWITCHYARD_RAY_NAMESPACE: one per deployment
sharing a cluster) and detached, so every ingress replica finds the same ones and they outlive the process that
created them; Ray restarts a replica that dies (max_restarts=-1), and the restarted
host reloads its snapshot and replays the change log from PostgreSQL.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from typing import Any

from indexes.errors import InvalidInput
from service.cluster.fanout import ShardSet
from service.cluster.shard_host import ShardHost
from service.database.postgres import EmbeddedPostgres
from service.settings import Settings

log = logging.getLogger("switchyard.cluster")

# What a shard host takes from the ingress's settings (the rest are the ingress's own: HTTP, auth, database pool).
SHARD_SETTINGS = ("batch_max", "batch_window_ms", "inline_search_us", "inline_turn_us", "consistency",
                  "bounded_staleness_ms", "consistency_timeout_ms", "replication_poll_ms", "rebuild_dead_fraction",
                  "rebuild_delta_rows", "db_command_timeout_s", "db_acquire_timeout_s", "cpu_threads", "huge_pages",
                  "gpu", "gpu_build_process", "admission", "breaker_failures", "breaker_cooldown_s", "duckdb_memory_mb")


def ray_module() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError("Ray is not installed: pip install 'switchyard[ray]'") from exc
    return ray


def connect(settings: Settings) -> Any:
    """Join the cluster at SWITCHYARD_RAY_ADDRESS ("auto": the one this machine is part of), once per process."""
    ray = ray_module()
    if not ray.is_initialized():
        ray.init(address=settings.cluster.ray_address or "auto", namespace=settings.cluster.ray_namespace,
                 ignore_reinit_error=True, log_to_driver=False)
    return ray


def actor_name(shard: int, shards: int, replica: int, domain: str = "vectors") -> str:
    return f"switchyard-{domain}-{shard}-of-{shards}-r{replica}"


def _actors(settings: Settings, domain: str, host: type, parts: int, replicas: int, *args: Any) -> list[list[Any]]:
    """Each part's replicas as actors, created if no process has yet (by name, so every ingress gets the same
    ones): host(*args, part, parts, replica, settings carried)."""
    ray = connect(settings)
    host_class = ray.remote(host)
    carried = {name: value for name, value in settings.flat().items() if name in SHARD_SETTINGS}
    return [[host_class.options(
        name=actor_name(p, parts, r, domain), namespace=settings.cluster.ray_namespace, get_if_exists=True,
        lifetime="detached", max_restarts=-1, max_task_retries=0, num_cpus=settings.cluster.shard_cpus,
        num_gpus=settings.cluster.shard_gpus, scheduling_strategy="SPREAD",
    ).remote(*args, p, parts, r, carried) for r in range(replicas)] for p in range(parts)]


def _shard_set(settings: Settings, replicas: list[list[Any]], *request_errors: type[BaseException]) -> ShardSet:
    """Calls to the actors; `request_errors`: what a replica raises for the request itself (the rest, a dead
    actor included, sends the call to another replica)."""
    async def call(actor: Any, method: str, args: tuple) -> Any:
        return await getattr(actor, method).remote(*args)

    return ShardSet(replicas, call, request_errors=(InvalidInput, *request_errors),
                    call_timeout_s=settings.cluster.shard_call_timeout_s)


async def vector_shards(settings: Settings, dsn: str) -> ShardSet:
    actors = _actors(settings, "vectors", ShardHost, settings.cluster.shards, settings.cluster.shard_replicas, dsn,
                     str(settings.data_dir))
    log.info("vector shards: %d x %d replicas on Ray %s", settings.cluster.shards, settings.cluster.shard_replicas,
             ray_module().__version__)
    return _shard_set(settings, actors)


async def olap_partitions(settings: Settings) -> ShardSet:
    from olap.queries import QueryParamError
    from service.cluster.olap_host import OlapHost

    actors = _actors(settings, "olap", OlapHost, settings.cluster.olap_partitions, settings.cluster.olap_replicas,
                     str(settings.data_dir))
    log.info("SSB partitions: %d x %d replicas", settings.cluster.olap_partitions, settings.cluster.olap_replicas)
    return _shard_set(settings, actors, QueryParamError)


async def spatial_partitions(settings: Settings, dsn: str) -> ShardSet:
    from service.cluster.spatial_host import SpatialHost
    from spatial.geoarrow import GeometryError

    c = settings.cluster
    actors = _actors(settings, "spatial", SpatialHost, c.spatial_partitions, c.spatial_replicas, dsn,
                     str(settings.data_dir))
    log.info("spatial partitions: %d x %d replicas", c.spatial_partitions, c.spatial_replicas)
    return _shard_set(settings, actors, GeometryError)


def remove_shard_actors(settings: Settings) -> int:
    """Kill the hosts (`switchyard serve --ray` at exit): detached actors outlive their creator otherwise."""
    ray = connect(settings)
    killed = 0
    c = settings.cluster
    for domain, parts, replicas in (("vectors", c.shards, c.shard_replicas),
                                    ("olap", c.olap_partitions, c.olap_replicas),
                                    ("spatial", c.spatial_partitions, c.spatial_replicas)):
        for p in range(parts):
            for r in range(replicas):
                try:
                    ray.kill(ray.get_actor(actor_name(p, parts, r, domain), namespace=settings.cluster.ray_namespace),
                             no_restart=True)
                    killed += 1
                except ValueError:
                    pass  # not there
    return killed


def ingress_app(replicas: int, env: dict[str, str], num_cpus: float = 1.0) -> Any:
    """The Ray Serve application: the same FastAPI app as `switchyard serve`, built in each ingress replica from
    the SWITCHYARD_* variables in `env` (its lifespan starts the runtime there, which joins the shard actors)."""
    from ray import serve

    @serve.deployment(name="switchyard", num_replicas=replicas,
                      ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": env}})
    @serve.ingress()
    class SwitchyardIngress:
        def __serve_build_asgi_app__(self) -> Any:
            from service.http.app import create_app

            return create_app()

    return SwitchyardIngress.bind()  # type: ignore[attr-defined]  # a Deployment: mypy keeps a decorated class's type


def _switchyard_env() -> dict[str, str]:
    """This process's SWITCHYARD_* variables: what the ingress replicas build their settings from."""
    return {k: v for k, v in os.environ.items() if k.startswith("SWITCHYARD_")}


def serve_app(args: dict[str, Any]) -> Any:
    """The application builder of a Ray Serve config file (`serve run serve.ray.yaml`): the ingress, configured
    by the SWITCHYARD_* variables of the application's runtime_env, which the replicas get too."""
    env = _switchyard_env()
    env.setdefault("SWITCHYARD_RAY_ADDRESS", "auto")
    return ingress_app(int(args.get("ingress_replicas", 1)), env, float(args.get("num_cpus", 1.0)))


def serve_on_ray(settings: Settings, address: str | None) -> None:
    """`switchyard serve --ray`: join (or start) a Ray cluster, run the ingress on Ray Serve at host:port, and
    stay until interrupted; then take the application and the shard actors down."""
    embedded = None
    env = _switchyard_env()
    if settings.database.url is None:
        # Shard hosts and ingress replicas all need one database: this machine's embedded server. Other machines
        # cannot reach it (it listens on this host only): a real cluster sets SWITCHYARD_DATABASE_URL.
        embedded = EmbeddedPostgres(settings.embedded_pgdata)
        env["SWITCHYARD_DATABASE_URL"] = embedded.start()
        log.warning("embedded PostgreSQL at %s serves this machine only: on a cluster of several machines set "
                    "SWITCHYARD_DATABASE_URL", settings.embedded_pgdata)
    ray = ray_module()
    if not ray.is_initialized():
        # No address: a Ray instance of this machine, with logical CPUs enough for every actor asked for even
        # on a small machine (they are scheduling units here; the cores are shared as in one process).
        c = settings.cluster
        wanted = c.shards * c.shard_replicas * c.shard_cpus + c.ray_ingress_replicas
        local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(wanted))} if address is None else {}
        ray.init(address=address, namespace=settings.cluster.ray_namespace, ignore_reinit_error=True, **local)
    env["SWITCHYARD_RAY_ADDRESS"] = "auto"  # the replicas run inside the cluster
    env["SWITCHYARD_DATA_DIR"] = str(settings.data_dir)
    from ray import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
        serve.run(ingress_app(settings.cluster.ray_ingress_replicas, env), name=settings.cluster.ray_namespace,
                  route_prefix="/")
        log.info("Switchyard on Ray Serve at http://%s:%d (%d ingress replica(s), %d shard(s) x %d replica(s))",
                 settings.server.host, settings.server.port, settings.cluster.ray_ingress_replicas,
                 settings.cluster.shards, settings.cluster.shard_replicas)
        stop.wait()
    finally:
        try:
            serve.delete(settings.cluster.ray_namespace)
            remove_shard_actors(settings)
        finally:
            if embedded is not None:
                embedded.stop()
