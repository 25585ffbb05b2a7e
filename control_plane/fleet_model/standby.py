"""Active-passive placement: a deployment's standby regions hold a warm minimum of
replicas (`max(1, min_replicas)` per standby region) that serve nothing while a primary
region is alive (routes flag them `standby`; gateways pass them over).

The snapshot side of it: where the serving replicas may go (`primary_regions`) and what
each standby is (`standby_demands`); setting the standby aside before the placer and
completing it afterwards is a step of the placement pipeline
(`control_plane.placement.standby`). While no primary region has a healthy cluster, the
primary demand may also use the standby regions, so the standby grows to the
deployment's full size until the primaries return.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from control_plane.fleet_model.snapshot import FleetSnapshot, VersionSpec
from control_plane.placement.standby import StandbyDemand
from fleet_base import residency
from fleet_base.domain import ClusterStatus

NO_REGION = "-no-primary-region-"  # matches no region: the primary demand is unplaceable


def in_regions(region: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(region, p) for p in patterns)


def standby_count(spec: VersionSpec) -> int:
    return max(1, spec.min_replicas)


def primary_regions(
    snap: FleetSnapshot, spec: VersionSpec, policy: Sequence[str] | None = None
) -> tuple[str, ...]:
    """Where the deployment's serving replicas may go: its allowed regions less the
    standby ones; every allowed or standby region while no primary has a healthy cluster
    that its residency `policy` permits (the placer narrows every region by it as well)."""
    if not spec.standby_regions:
        return spec.regions
    known = sorted({c.region for c in snap.clusters})
    allowed = [r for r in known if not spec.regions or in_regions(r, spec.regions)]
    primary = [r for r in allowed if not in_regions(r, spec.standby_regions)]
    permitted = residency.allowed(policy)
    if not any(
        c.region in primary
        and c.status == ClusterStatus.healthy
        and residency.permits(permitted, c.jurisdiction)
        for c in snap.clusters
    ):
        return tuple(sorted(set(allowed) | {r for r in known if in_regions(r, spec.standby_regions)})) or (
            NO_REGION,
        )
    return tuple(primary) or (NO_REGION,)


def standby_demands(snap: FleetSnapshot) -> list[StandbyDemand]:
    """Each deployment's warm standby, as the placement pipeline takes it: its current
    version, `standby_count` replicas in every known region its standby patterns match."""
    out = []
    for d in snap.deployments:
        spec = snap.specs.get((d.name, d.current_version))
        if spec is None or not spec.standby_regions or d.replicas <= 0:
            continue
        out.append(
            StandbyDemand(
                deployment=d.name,
                version=spec.version,
                count=standby_count(spec),
                gpu_models=spec.gpu_models,
                gpu_count=spec.gpu_count,
                gpu_memory_gb=spec.gpu_memory_gb,
                regions=tuple(
                    sorted({c.region for c in snap.clusters if in_regions(c.region, spec.standby_regions)})
                ),
                residency=d.residency,
            )
        )
    return out
