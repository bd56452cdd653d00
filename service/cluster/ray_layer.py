"""Switchyard on a Ray cluster: vector shard hosts as Ray actors, the same FastAPI app as a Ray Serve ingress.

Ray is the optional `ray` extra; nothing imports this module unless SWITCHYARD_RAY_ADDRESS is set (or
`switchyard serve --ray` runs). Actors are named (in the namespace SWITCHYARD_RAY_NAMESPACE: one per deployment
sharing a cluster) and detached, so every ingress replica finds the same ones and they outlive the process that
created them; Ray restarts a replica that dies (max_restarts=-1) in the placement-group bundle kept for it
(placement.py), and the restarted host reloads its snapshot and replays the change log from PostgreSQL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from indexes.errors import InvalidInput
from service.cluster.fanout import ShardSet
from service.cluster.placement import (
    INGRESS_CPUS,
    CannotPlace,
    Footprint,
    bundle_strategy,
    local_cpus,
    release,
    reserve,
    reserved,
)
from service.cluster.serve_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from service.cluster.shard_host import ShardHost
from service.database.postgres import EmbeddedPostgres
from service.settings import Settings

log = logging.getLogger("switchyard.cluster")

# What a shard host takes from the ingress's settings (the rest are the ingress's own: HTTP, auth, database pool).
SHARD_SETTINGS = ("batch_max", "batch_window_ms", "inline_search_us", "inline_turn_us", "consistency",
                  "bounded_staleness_ms", "consistency_timeout_ms", "replication_poll_ms", "rebuild_dead_fraction",
                  "rebuild_delta_rows", "db_command_timeout_s", "db_acquire_timeout_s", "cpu_threads", "huge_pages",
                  "gpu", "gpu_build_process", "admission", "breaker_failures", "breaker_cooldown_s", "duckdb_memory_mb",
                  "shard_call_timeout_s")


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


async def _actors(settings: Settings, domain: str, host: type, parts: int, replicas: int, *args: Any
                  ) -> list[list[Any]]:
    """Each part's replicas as actors, created if no process has yet (by name, so every ingress gets the same
    ones), each in its own bundle of the domain's placement group: host(*args, part, parts, replica, settings
    carried). CannotPlace when the cluster cannot hold them all."""
    ray = connect(settings)
    group = await reserved(ray, Footprint.of(settings), domain)
    host_class = ray.remote(host)
    carried = {name: value for name, value in settings.flat().items() if name in SHARD_SETTINGS}
    # Ray warns, once per actor, that removing a group kills a restartable detached actor in it for good: what
    # remove_shard_actors() wants (a group lives as long as its deployment).
    ray_actor_log = logging.getLogger("ray.actor")
    level = ray_actor_log.level
    ray_actor_log.setLevel(logging.ERROR)
    try:
        return [[host_class.options(
            name=actor_name(p, parts, r, domain), namespace=settings.cluster.ray_namespace, get_if_exists=True,
            lifetime="detached", max_restarts=-1, max_task_retries=0, num_cpus=settings.cluster.shard_cpus,
            num_gpus=settings.cluster.shard_gpus, scheduling_strategy=bundle_strategy(group, p * replicas + r),
        ).remote(*args, p, parts, r, carried) for r in range(replicas)] for p in range(parts)]
    finally:
        ray_actor_log.setLevel(level)


def _shard_set(settings: Settings, replicas: list[list[Any]], *request_errors: type[BaseException]) -> ShardSet:
    """Calls to the actors; `request_errors`: what a replica raises for the request itself (the rest, a dead
    actor included, sends the call to another replica)."""
    async def call(actor: Any, method: str, args: tuple) -> Any:
        return await getattr(actor, method).remote(*args)

    return ShardSet(replicas, call, request_errors=(InvalidInput, *request_errors),
                    call_timeout_s=settings.cluster.shard_call_timeout_s)


async def vector_shards(settings: Settings, dsn: str) -> ShardSet:
    c = settings.cluster
    actors = await _actors(settings, "vectors", ShardHost, c.shards, c.shard_replicas, dsn, str(settings.data_dir))
    log.info("vector shards: %d x %d replicas on Ray %s", settings.cluster.shards, settings.cluster.shard_replicas,
             ray_module().__version__)
    return _shard_set(settings, actors)


async def olap_partitions(settings: Settings) -> ShardSet:
    from olap.queries import QueryParamError
    from service.cluster.olap_host import OlapHost

    c = settings.cluster
    actors = await _actors(settings, "olap", OlapHost, c.olap_partitions, c.olap_replicas, str(settings.data_dir))
    log.info("SSB partitions: %d x %d replicas", settings.cluster.olap_partitions, settings.cluster.olap_replicas)
    return _shard_set(settings, actors, QueryParamError)


async def spatial_partitions(settings: Settings, dsn: str) -> ShardSet:
    from service.cluster.spatial_host import SpatialHost
    from spatial.geoarrow import GeometryError

    c = settings.cluster
    actors = await _actors(settings, "spatial", SpatialHost, c.spatial_partitions, c.spatial_replicas, dsn,
                           str(settings.data_dir))
    log.info("spatial partitions: %d x %d replicas", c.spatial_partitions, c.spatial_replicas)
    return _shard_set(settings, actors, GeometryError)


def remove_shard_actors(settings: Settings) -> int:
    """Kill the hosts and remove their placement groups (`switchyard serve --ray` at exit): detached actors and
    groups outlive their creator otherwise."""
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
    release(ray, Footprint.of(settings))
    return killed


def ingress_app(replicas: int, env: dict[str, str], num_cpus: float = INGRESS_CPUS) -> Any:
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
    return ingress_app(int(args.get("ingress_replicas", 2)), env, float(args.get("num_cpus", INGRESS_CPUS)))


def serve_on_ray(settings: Settings, address: str | None, num_cpus: int | None = None) -> None:
    """`switchyard serve --ray`: join (or start) a Ray cluster, place every actor the deployment will start (or
    refuse, CannotPlace), run the ingress on Ray Serve at host:port, and stay until interrupted; then take the
    application and the shard actors down. `num_cpus`: the logical CPUs of a local Ray (default: enough for
    every actor)."""
    c = settings.cluster
    footprint = Footprint.of(settings, ingress=c.ray_ingress_replicas)
    ray = ray_module()
    local: dict[str, Any] = {}
    if address is None and not ray.is_initialized():
        # A Ray instance of this machine with logical CPUs for every actor even on a small machine (they are
        # scheduling units here; the cores are shared as in one process).
        local["num_cpus"] = local_cpus(footprint, os.cpu_count() or 1, num_cpus)
    elif num_cpus is not None:
        raise CannotPlace("--num-cpus sizes the local Ray that `serve --ray` starts without --address; a cluster "
                          "joined has the CPUs its nodes give")
    embedded = None
    env = _switchyard_env()
    if settings.database.url is None:
        # Shard hosts and ingress replicas all need one database: this machine's embedded server. Other machines
        # cannot reach it (it listens on this host only): a real cluster sets SWITCHYARD_DATABASE_URL.
        embedded = EmbeddedPostgres(settings.embedded_pgdata)
        env["SWITCHYARD_DATABASE_URL"] = embedded.start()
        log.warning("embedded PostgreSQL at %s serves this machine only: on a cluster of several machines set "
                    "SWITCHYARD_DATABASE_URL", settings.embedded_pgdata)
    env["SWITCHYARD_RAY_ADDRESS"] = "auto"  # the replicas run inside the cluster
    env["SWITCHYARD_DATA_DIR"] = str(settings.data_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    placed = served = False
    try:
        if not ray.is_initialized():
            if address is None:  # Serve's proxy in the local Ray answers a request lost with its replica 503
                os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
            # "local": a new instance, never one found on this machine (ray.init(None) joins a `ray start` one)
            ray.init(address=address or "local", namespace=c.ray_namespace, ignore_reinit_error=True, **local)
        log.info("this deployment reserves %s on Ray %s (%s)", footprint, ray.__version__,
                 f"a local Ray of {local['num_cpus']} logical CPUs" if local else f"cluster {address}")
        placed = True  # from here on, whatever was placed is removed at exit
        for domain in footprint.layout:
            reserve(ray, footprint, domain)  # every part's actors have their bundle before any starts
        from ray import serve

        serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
        served = True
        serve.run(ingress_app(c.ray_ingress_replicas, env), name=c.ray_namespace, route_prefix="/")
        log.info("Switchyard on Ray Serve at http://%s:%d (%s)", settings.server.host, settings.server.port,
                 footprint)
        stop.wait()
    finally:
        try:
            if served:
                serve.delete(c.ray_namespace)
            if placed:
                remove_shard_actors(settings)
        finally:
            if embedded is not None:
                embedded.stop()
