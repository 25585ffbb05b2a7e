"""Make-before-break for a cluster that went silent.

Silence is all the control plane knows: the cluster may be gone, or only its heartbeats
(a stalled agent, a lost route to NATS while desired state still arrives). Giving its
replicas up at once costs nothing in the first case and, in the second, has a live agent
stop every warm replica it runs, with nowhere else to put them or long before their
replacements are ready.

So the placer re-places them as before (a silent cluster keeps nothing), and this step
then holds those that were ready when the silence began (`UNREACHABLE` in the control
plane's records) for as long as their deployment version has fewer ready replicas
elsewhere than it wants. Their routes are gone either way (`build_routes` leaves silent
clusters out); what is held is the desired state their agent is told. When the cluster
heart-beats again its replicas are ready again and simply kept; when the replacements are
ready the held ones go.

Pure; the same in the reconcile loop, `fleetctl plan` and tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand
from fleet_base.domain import ClusterStatus

UNREACHABLE = "unreachable"
"""The control plane's own state for a replica that was ready when its cluster went silent
(never on the wire: the agent reports the real state again when it is heard)."""


def hold_unreachable(
    result: PlacementResult,
    current: Sequence[Assignment],
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    ready: Collection[str],
    unreachable: Collection[str],
) -> PlacementResult:
    """`result` with the removed replicas of silent clusters kept back, each deployment
    version's up to the ready replicas it still lacks elsewhere (`ready`: the ids last
    reported ready; `unreachable`: those that were ready when their cluster went silent)."""
    silent = {p.cluster for p in pools if p.cluster_status == ClusterStatus.unhealthy}
    removed = set(result.removed) - {p.replica_id for p in result.preempted}
    candidates: dict[tuple[str, int], list[Assignment]] = defaultdict(list)
    for a in current:
        if a.replica_id in removed and a.replica_id in unreachable and a.cluster in silent:
            candidates[(a.deployment, a.version)].append(a)
    if not candidates:
        return result
    wanted = {(d.deployment, d.version): d.count for d in demands}
    serving: dict[tuple[str, int], int] = defaultdict(int)
    for a in result.assignments:
        if a.replica_id in ready and a.cluster not in silent:
            serving[(a.deployment, a.version)] += 1
    held: list[Assignment] = []
    for key, waiting in sorted(candidates.items()):
        lacking = wanted.get(key, 0) - serving[key]
        held += sorted(waiting, key=lambda a: a.replica_id)[: max(0, lacking)]
    if not held:
        return result
    ids = {a.replica_id for a in held}
    return result.model_copy(
        update={
            "kept": result.kept + tuple(held),
            "removed": tuple(r for r in result.removed if r not in ids),
        }
    )
