"""Make-before-break for a cluster that went silent.

Silence is all the control plane knows: the cluster may be gone, or only its heartbeats
(a stalled agent, a lost route to NATS while desired state still arrives). Giving its
replicas up at once costs nothing in the first case and, in the second, has a live agent
stop every warm replica it runs, with nowhere else to put them or long before their
replacements are ready.

So the replicas of a silent cluster that were ready when the silence began (`UNREACHABLE`
in the control plane's records) are set aside before the placer runs (`waiting`): it
places the deployment as if they were gone, replacements included, and its plan stays the
same pass after pass (the optimizing placer's warm start still matches). This step then
keeps each version's waiting replicas while it has fewer ready replicas elsewhere than it
wants, and removes the rest. Their routes are gone either way (`build_routes` leaves silent
clusters out); what is held is the desired state their agent is told. The reconcile loop
passes a replica as unreachable only for `Settings.unreachable_hold_s` after its cluster's
last heartbeat (as Kubernetes evicts from an unreachable node after 300 s), so a cluster
that is really gone lets go of its replicas, its GPU-hours and its deletion.

Pure; the same in the reconcile loop, `fleetctl plan` and tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand
from fleet_base.domain import ClusterStatus

UNREACHABLE = "unreachable"
"""The control plane's own state for a replica that was ready when its cluster went silent
(never on the wire: the agent reports the real state again when it is heard)."""


def silent_clusters(pools: Sequence[PoolCapacity]) -> set[str]:
    return {p.cluster for p in pools if p.cluster_status == ClusterStatus.unhealthy}


def waiting(
    current: Sequence[Assignment], pools: Sequence[PoolCapacity], unreachable: Collection[str]
) -> tuple[Assignment, ...]:
    """The current replicas this step decides on: unreachable, on a cluster not healthy
    (silent, or cordoned while silent: a cordon keeps what runs, and nothing is known to)."""
    healthy = {p.cluster for p in pools if p.cluster_status == ClusterStatus.healthy}
    return tuple(a for a in current if a.replica_id in unreachable and a.cluster not in healthy)


def hold_unreachable(
    result: PlacementResult,
    held_back: Sequence[Assignment],
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    ready: Collection[str],
) -> PlacementResult:
    """The placer's `result` (made without `held_back`, standby not added yet) with each
    deployment version's `held_back` replicas kept, lowest ids first, up to the ready
    replicas it lacks on the other clusters (`ready`: ids last reported ready); the rest
    removed."""
    if not held_back:
        return result
    silent = silent_clusters(pools)
    wanted = {(d.deployment, d.version): d.count for d in demands}
    serving: dict[tuple[str, int], int] = defaultdict(int)
    for a in result.assignments:
        if a.replica_id in ready and a.cluster not in silent:
            serving[(a.deployment, a.version)] += 1
    by_key: dict[tuple[str, int], list[Assignment]] = defaultdict(list)
    for a in held_back:
        by_key[(a.deployment, a.version)].append(a)
    kept: list[Assignment] = []
    for key, replicas in sorted(by_key.items()):
        lacking = max(0, wanted.get(key, 0) - serving[key])
        kept += sorted(replicas, key=lambda a: a.replica_id)[:lacking]
    ids = {a.replica_id for a in kept}
    gone = tuple(sorted(a.replica_id for a in held_back if a.replica_id not in ids))
    return result.model_copy(update={"kept": result.kept + tuple(kept), "removed": result.removed + gone})
