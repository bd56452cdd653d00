"""What a deployment's actors reserve on Ray, and the reservation itself.

Every actor a deployment starts (vector shards x replicas, SSB partitions x replicas, spatial partitions x
replicas) gets a bundle of its own in a placement group of its domain, named and detached like the actors: Ray
places a group whole or not at all, and a bundle's CPUs and GPUs stay with the group while the actor in it is
dead or restarting, so a replica that was killed always comes back (nothing pending elsewhere can take its CPU).
A deployment whose groups cannot be placed (a cluster too small) refuses to start and says with what numbers.
`switchyard serve --ray` sizes the local Ray it starts from the same numbers (local_cpus()).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from service.settings import Settings

log = logging.getLogger("switchyard.cluster")

PLACEMENT_WAIT_S = 60.0  # how long a deployment waits for its groups to be placed before it refuses to start
INGRESS_CPUS = 1.0  # what one Ray Serve replica of the ingress reserves (ray_layer.ingress_app)
LABELS = {"vectors": "vector shards", "olap": "SSB partitions", "spatial": "spatial partitions"}


class CannotPlace(RuntimeError):
    """The actors of this deployment cannot all be scheduled as asked: the message says why, with the numbers."""


@dataclass(frozen=True)
class Footprint:
    layout: dict[str, tuple[int, int]]  # domain -> (parts, replicas); a domain with 0 parts starts no actor
    cpus: float  # per actor
    gpus: float  # per actor
    ingress: int = 0  # Ray Serve replicas of the ingress (0: the ingress runs outside Ray)

    @classmethod
    def of(cls, settings: Settings, ingress: int = 0) -> Footprint:
        c = settings.cluster
        return cls({"vectors": (c.shards, c.shard_replicas), "olap": (c.olap_partitions, c.olap_replicas),
                    "spatial": (c.spatial_partitions, c.spatial_replicas)}, c.shard_cpus, c.shard_gpus, ingress)

    def actors(self, domain: str | None = None) -> int:
        return sum(parts * replicas for d, (parts, replicas) in self.layout.items() if domain in (None, d))

    @property
    def total_cpus(self) -> float:
        return self.actors() * self.cpus + self.ingress * INGRESS_CPUS

    @property
    def total_gpus(self) -> float:
        return self.actors() * self.gpus

    def bundle(self) -> dict[str, float]:
        """One actor's reservation (empty when it reserves nothing: such actors are placed anywhere)."""
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}

    def __str__(self) -> str:
        parts = ", ".join(f"{LABELS[d]} {p} x {r}" for d, (p, r) in self.layout.items() if p)
        each = f"{self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")
        ingress = f" + {self.ingress} ingress replica(s) x {INGRESS_CPUS:g} CPU" if self.ingress else ""
        gpus = f" and {self.total_gpus:g} GPU(s)" if self.gpus else ""
        return f"{parts}: {self.actors()} actors x {each}{ingress} = {self.total_cpus:g} CPU(s){gpus}"


def local_cpus(footprint: Footprint, cores: int, requested: int | None = None) -> int:
    """The logical CPUs of a local Ray for this deployment: `requested`, or as many as every actor reserves (at
    least the machine's cores; they are scheduling units here, the cores are shared as in one process).
    CannotPlace when `requested` is fewer than the actors reserve."""
    needed = math.ceil(footprint.total_cpus - 1e-9)
    if requested is None:
        return max(cores, needed)
    if requested < needed:
        raise CannotPlace(f"--num-cpus {requested} is too few for this deployment: {footprint}; give "
                              f"--num-cpus {needed} or more, or fewer or smaller actors (SWITCHYARD_SHARD_CPUS, "
                              "the *_PARTITIONS and *_REPLICAS settings)")
    return requested


def group_name(domain: str, parts: int, replicas: int) -> str:
    return f"switchyard-{domain}-{parts}x{replicas}"


def _group(ray: Any, name: str, bundles: list[dict[str, float]]) -> tuple[Any, bool]:
    """The named group of this namespace, created if no process has yet; (group, created here)."""
    from ray.util import get_placement_group, placement_group

    try:
        group, created = get_placement_group(name), False
    except ValueError:  # not there yet
        try:
            group, created = placement_group(bundles, strategy="SPREAD", name=name, lifetime="detached"), True
        except Exception:  # noqa: BLE001 - another ingress created it a moment ago (Ray refuses a second name)
            group, created = get_placement_group(name), False
    if [{k: float(v) for k, v in b.items()} for b in group.bundle_specs] != bundles:
        raise CannotPlace(f"placement group {name} of this namespace reserves {group.bundle_specs[0]} per actor, "
                              f"this deployment {bundles[0]}: stop the deployment that made it, or give this one "
                              "another SWITCHYARD_RAY_NAMESPACE")
    return group, created


def _refusal(ray: Any, footprint: Footprint, domain: str, waited_s: float) -> CannotPlace:
    total, free = ray.cluster_resources(), ray.available_resources()
    have = " and ".join(f"{total[k]:g} {k}(s) ({free.get(k, 0):g} free now)" for k in ("CPU", "GPU") if k in total)
    return CannotPlace(f"the {LABELS[domain]} of this deployment could not all be placed within {waited_s:g} s: "
                           f"it needs {footprint} and the cluster has {have or 'no CPUs'}; add nodes, or start fewer "
                           "or smaller actors (SWITCHYARD_SHARD_CPUS, the *_PARTITIONS and *_REPLICAS settings)")


def _prepared(ray: Any, footprint: Footprint, domain: str) -> tuple[Any, bool] | None:
    bundle = footprint.bundle()
    parts, replicas = footprint.layout[domain]
    if not bundle or not parts:
        return None
    return _group(ray, group_name(domain, parts, replicas), [bundle] * (parts * replicas))


def reserve(ray: Any, footprint: Footprint, domain: str, wait_s: float = PLACEMENT_WAIT_S) -> Any:
    """The placement group of a domain's actors, placed (blocking; the driver of `serve --ray`); None when its
    actors reserve nothing. CannotPlace when it is not placed within wait_s."""
    prepared = _prepared(ray, footprint, domain)
    if prepared is None:
        return None
    group, created = prepared
    try:
        ray.get(group.ready(), timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        raise _give_up(ray, footprint, domain, group, created, wait_s) from None
    return group


async def reserved(ray: Any, footprint: Footprint, domain: str, wait_s: float = PLACEMENT_WAIT_S) -> Any:
    """reserve() for an ingress's event loop."""
    prepared = await asyncio.to_thread(_prepared, ray, footprint, domain)
    if prepared is None:
        return None
    group, created = prepared
    try:
        await asyncio.wait_for(asyncio.wrap_future(group.ready().future()), wait_s)
    except TimeoutError:
        raise _give_up(ray, footprint, domain, group, created, wait_s) from None
    return group


def _give_up(ray: Any, footprint: Footprint, domain: str, group: Any, created: bool, waited_s: float
             ) -> CannotPlace:
    refusal = _refusal(ray, footprint, domain, waited_s)
    if created:  # no pending group left behind by a deployment that did not start
        ray.util.remove_placement_group(group)
    log.error("%s", refusal)
    return refusal


def bundle_strategy(group: Any, index: int) -> Any:
    """Where actor `index` of a domain (part * replicas + replica) runs: its own bundle, or anywhere spread."""
    if group is None:
        return "SPREAD"
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def release(ray: Any, footprint: Footprint) -> int:
    """Remove the deployment's groups (the actors in them go too); how many there were."""
    from ray.util import get_placement_group

    removed = 0
    for domain, (parts, replicas) in footprint.layout.items():
        try:
            ray.util.remove_placement_group(get_placement_group(group_name(domain, parts, replicas)))
            removed += 1
        except ValueError:
            pass  # not there
    return removed
