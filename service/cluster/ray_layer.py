"""Switchyard on a Ray cluster: vector shard hosts as Ray actors, the same FastAPI app as a Ray Serve ingress.

Ray is the optional `ray` extra; nothing imports this module unless SWITCHYARD_RAY_ADDRESS is set (or
`switchyard serve --ray` runs). Actors are named and detached, so every ingress replica finds the same ones and
they outlive the process that created them; Ray restarts a replica that dies (max_restarts=-1), and the restarted
host reloads its snapshot and replays the change log from PostgreSQL.
"""

from __future__ import annotations

import logging
from typing import Any

from ..settings import Settings
from .fanout import ShardSet
from .shard_host import ShardHost

log = logging.getLogger("switchyard.cluster")

NAMESPACE = "switchyard"
# What a shard host takes from the ingress's settings (the rest are the ingress's own: HTTP, auth, database pool).
SHARD_SETTINGS = ("batch_max", "batch_window_ms", "inline_search_us", "inline_burst", "consistency",
                  "bounded_staleness_ms", "consistency_timeout_ms", "replication_poll_ms", "rebuild_dead_fraction",
                  "rebuild_delta_rows", "db_command_timeout_s", "db_acquire_timeout_s", "cpu_threads", "gpu",
                  "admission", "breaker_failures", "breaker_cooldown_s")


def ray_module() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError("Ray is not installed: pip install 'switchyard[ray]'") from exc
    return ray


def connect(address: str | None) -> Any:
    """Join the cluster at `address` ("auto": the one this machine belongs to), once per process."""
    ray = ray_module()
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False)
    return ray


def actor_name(shard: int, shards: int, replica: int) -> str:
    return f"switchyard-vectors-{shard}-of-{shards}-r{replica}"


def shard_actors(settings: Settings, dsn: str) -> list[list[Any]]:
    """The shard hosts' actors, created if no process has yet (by name, so every ingress gets the same ones)."""
    ray = connect(settings.ray_address)
    host_class = ray.remote(ShardHost)
    carried = {name: getattr(settings, name) for name in SHARD_SETTINGS}
    shards, replicas = settings.shards, settings.shard_replicas
    return [[host_class.options(
        name=actor_name(s, shards, r), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        max_restarts=-1, max_task_retries=0, num_cpus=settings.shard_cpus, num_gpus=settings.shard_gpus,
        scheduling_strategy="SPREAD",
    ).remote(dsn, str(settings.data_dir), s, shards, r, carried) for r in range(replicas)] for s in range(shards)]


async def vector_shards(settings: Settings, dsn: str) -> ShardSet:
    ray = ray_module()
    from ray.exceptions import ActorUnavailableError, RayActorError

    async def call(actor: Any, method: str, args: tuple) -> Any:
        return await getattr(actor, method).remote(*args)

    shard_set = ShardSet(shard_actors(settings, dsn), call, down=(RayActorError, ActorUnavailableError),
                         call_timeout_s=settings.shard_call_timeout_s)
    log.info("vector shards: %d x %d replicas on Ray %s", settings.shards, settings.shard_replicas, ray.__version__)
    return shard_set


def remove_shard_actors(settings: Settings) -> int:
    """Kill the shard hosts (`switchyard serve --ray` at exit): detached actors outlive their creator otherwise."""
    ray = connect(settings.ray_address)
    killed = 0
    for s in range(settings.shards):
        for r in range(settings.shard_replicas):
            try:
                ray.kill(ray.get_actor(actor_name(s, settings.shards, r), namespace=NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:
                pass  # not there
    return killed
