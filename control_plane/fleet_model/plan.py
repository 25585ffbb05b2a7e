"""Pure decisions of the reconcile loop: snapshot -> placement inputs, placement result
-> the new assignment, and the assignment -> what NATS should hold (desired state per
cluster, a routing table per deployment, key records). No I/O, no clock."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from control_plane.fleet_model.nodes import healthy_pools
from control_plane.fleet_model.snapshot import AssignmentRow, DeploymentRow, FleetSnapshot, VersionSpec
from control_plane.fleet_model.standby import in_regions, primary_regions
from control_plane.geo.routes import by_region_for
from control_plane.placement import Assignment, PlacementResult, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import slot_size
from control_plane.placement.explain import RemovalContext
from control_plane.placement.explain import removal_reasons as explain_removals
from control_plane.rollouts.surge import (
    CapacityInputs,
    CapacityPlan,
    plan_capacity,
    plan_drain,
    resolve_surge,
    resolve_unavailable,
)
from fleet_base import residency
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.domain import ClusterStatus, pool_shape
from fleet_base.node_health import NodeAction
from fleet_base.pipelines import PipelineSpec
from fleet_base.protocol import (
    DEFAULT_MAX_ADAPTERS,
    ClusterRoute,
    DesiredState,
    LoRAAdapterSpec,
    ReplicaSpec,
    ReplicaState,
    Resources,
    RoutingTable,
    ShadowTarget,
    VersionWeight,
)

# What a placer's `Assignment` and the snapshot's `AssignmentRow` both say of a replica.
PLACED = {"replica_id", "deployment", "version", "cluster", "pool", "gpus"}


def placement_inputs(
    snap: FleetSnapshot, nodes: Mapping[str, int] | None = None
) -> tuple[list[ReplicaDemand], list[PoolCapacity], list[Assignment]]:
    """Demands (each deployment's current version x desired replicas), every pool of
    every cluster (the placer decides by cluster status), and the current assignment
    with node indices remembered from the last plan (`nodes`, by replica id)."""
    nodes = nodes or {}
    demands = []
    for d in snap.deployments:
        for version, count in version_counts(snap, d).items():
            spec = snap.specs.get((d.name, version))
            if spec is None:
                continue
            demands.append(_demand(snap, d, spec, count))
    ready = ReplicaState.ready.value
    current = [
        Assignment(**a.model_dump(include=PLACED), node=nodes.get(a.replica_id), ready=a.state == ready)
        for a in snap.assignments
    ]
    return demands, healthy_pools(snap, _pools(snap)), current


def _demand(snap: FleetSnapshot, d: DeploymentRow, spec: VersionSpec, count: int) -> ReplicaDemand:
    gpu_models = spec.gpu_models
    mix = tuple(m for m, n in d.variant_mix.items() if n > 0) if spec.version == d.current_version else ()
    if mix:  # the autoscaler's cheapest GPU types: the placer's cost objective fills them in order
        gpu_models = mix
    return ReplicaDemand(
        deployment=d.name,
        version=spec.version,
        count=count,
        gpu_models=gpu_models,
        gpu_count=spec.gpu_count,
        gpu_memory_gb=spec.gpu_memory_gb,
        regions=primary_regions(snap, spec, d.residency),
        min_regions=spec.min_regions,
        priority=d.priority,
        residency=d.residency,
    )


def _pools(snap: FleetSnapshot) -> list[PoolCapacity]:
    return [
        PoolCapacity(
            cluster=c.id,
            name=p.name,
            region=c.region,
            cluster_status=c.status,
            coordinates=c.coordinates,
            provider=c.provider,
            jurisdiction=c.jurisdiction,
            **pool_shape(p),
        )
        for c in snap.clusters
        for p in c.pools
    ]


def version_counts(snap: FleetSnapshot, d: DeploymentRow) -> dict[int, int]:
    """Replicas wanted per live version: during a canary rollout what the surge budget
    allows (`capacity_plan`); after one ends or the version changes, while replicas of
    another version are still ready, the same budget going the other way
    (`replacement_plan`); else the current version alone."""
    total = max(0, d.replicas)
    rollout = snap.rollouts.get(d.name)
    plan = capacity_plan(snap, d)
    if rollout is not None and plan is not None:
        return {d.current_version: plan.baseline, rollout.canary_version: plan.canary}
    if rollout is None:
        replacing = replacement_plan(snap, d)
        if replacing is not None:
            old, plan = replacing
            return {d.current_version: plan.canary, old: plan.baseline}
    return {d.current_version: total}


def replacement_plan(snap: FleetSnapshot, d: DeploymentRow) -> tuple[int, CapacityPlan] | None:
    """(old version, plan) when ready replicas of a version other than the current one
    remain (a rolled-back or aborted canary, the baseline after a promotion, a spec
    change without a rollout): the current version is brought to full size by the
    budget (`plan_drain`): old replicas go as fast as the ready count of both versions
    together allows, never below `replicas - max_unavailable`. Old replicas that are not
    ready serve nothing and go at once."""
    ready = ReplicaState.ready.value
    mine = [a for a in snap.assignments if a.deployment == d.name]
    old_ready: dict[int, int] = defaultdict(int)
    for a in mine:
        if a.version != d.current_version and a.state == ready and (d.name, a.version) in snap.specs:
            old_ready[a.version] += 1
    spec = snap.specs.get((d.name, d.current_version))
    if not old_ready or spec is None:
        return None
    old = max(old_ready, key=lambda v: (old_ready[v], v))
    total = max(0, d.replicas)
    keep = {a.replica_id for a in mine if a.version == old and a.state == ready}
    # Every other replica of an old version is on its way out: its GPUs count as free.
    leaving = {a.replica_id for a in mine if a.version != d.current_version and a.replica_id not in keep}
    plan = plan_drain(
        CapacityInputs(
            replicas=total,
            canary_wanted=total,
            canary_ready=sum(1 for a in mine if a.version == d.current_version and a.state == ready),
            canary_assigned=sum(1 for a in mine if a.version == d.current_version),
            baseline_assigned=len(keep),
            baseline_ready=len(keep),
            free_slots=_free_slots(snap, _demand(snap, d, spec, 1), leaving),
            max_surge=resolve_surge(d.max_surge, total),
            max_unavailable=resolve_unavailable(d.max_unavailable, total),
        )
    )
    return old, plan


def _free_slots(snap: FleetSnapshot, shape: ReplicaDemand, leaving: set[str] = frozenset()) -> int:
    """Further replicas of `shape` the healthy pools it accepts could take."""
    used: dict[tuple[str, str], int] = defaultdict(int)
    for a in snap.assignments:
        if a.replica_id not in leaving:
            used[(a.cluster, a.pool)] += a.gpus
    return sum(
        int(max(0, p.total_gpus - used[p.key]) // slot_size(shape.gpu_count, p.gpus_per_node))
        for p in _pools(snap)
        if p.accepts_new and shape.acceptable(p)
    )


def capacity_plan(snap: FleetSnapshot, d: DeploymentRow) -> CapacityPlan | None:
    """Surge or replace for a deployment in a canary rollout (None when not in one):
    free capacity is counted for the canary's shape on healthy pools it accepts."""
    rollout = snap.rollouts.get(d.name)
    spec = snap.specs.get((d.name, rollout.canary_version)) if rollout else None
    if rollout is None or rollout.canary_version == d.current_version or spec is None:
        return None
    total = max(0, d.replicas)
    mine = [a for a in snap.assignments if a.deployment == d.name]
    ready = ReplicaState.ready.value
    free = _free_slots(snap, _demand(snap, d, spec, 1))
    return plan_capacity(
        CapacityInputs(
            replicas=total,
            canary_wanted=min(total, rollout.canary_replicas),
            canary_ready=sum(1 for a in mine if a.version == rollout.canary_version and a.state == ready),
            canary_assigned=sum(1 for a in mine if a.version == rollout.canary_version),
            baseline_assigned=sum(1 for a in mine if a.version == d.current_version),
            baseline_ready=sum(1 for a in mine if a.version == d.current_version and a.state == ready),
            free_slots=free,
            max_surge=resolve_surge(d.max_surge, total),
            max_unavailable=resolve_unavailable(d.max_unavailable, total),
            shadowing=rollout.shadowing,
        )
    )


def version_weights(snap: FleetSnapshot, d: DeploymentRow) -> list[VersionWeight]:
    """Routing weights: the current version alone, or canary first (so sticky users in
    the canary's share stay there as it grows) and the baseline with the rest."""
    rollout = snap.rollouts.get(d.name)
    if rollout is None:
        replacing = replacement_plan(snap, d)
        if replacing is not None and replacing[1].baseline > 0:
            return _ready_shares(snap, d, replacing[0])
    if rollout is None or rollout.canary_version == d.current_version:
        return [VersionWeight(version=d.current_version, weight=1.0)]
    share = min(100.0, max(0.0, rollout.canary_weight)) / 100
    return [
        VersionWeight(version=rollout.canary_version, weight=round(share, 6)),
        VersionWeight(version=d.current_version, weight=round(1 - share, 6)),
    ]


def _ready_shares(snap: FleetSnapshot, d: DeploymentRow, old: int) -> list[VersionWeight]:
    """While old replicas are drained: each version's share of the ready replicas, the
    current one first (a version with none ready gets no traffic)."""
    ready = ReplicaState.ready.value
    n = {
        v: sum(1 for a in snap.assignments if a.deployment == d.name and a.version == v and a.state == ready)
        for v in (d.current_version, old)
    }
    total = sum(n.values()) or 1
    return [VersionWeight(version=v, weight=round(k / total, 6)) for v, k in n.items() if k > 0] or [
        VersionWeight(version=d.current_version, weight=1.0)
    ]


def next_assignments(snap: FleetSnapshot, result: PlacementResult) -> list[AssignmentRow]:
    """The assignment after applying `result`: kept rows keep their state and URL, new
    ones start 'pending'."""
    removed = set(result.removed)
    rows = [a for a in snap.assignments if a.replica_id not in removed]
    rows += [
        AssignmentRow(**a.model_dump(include=PLACED), state=ReplicaState.pending.value) for a in result.added
    ]
    return sorted(rows, key=lambda a: a.replica_id)


def removal_context(snap: FleetSnapshot) -> RemovalContext:
    """What the placement pipeline's explain step needs from the snapshot."""
    return RemovalContext(
        current_versions={d.name: d.current_version for d in snap.deployments},
        canary_versions={name: r.canary_version for name, r in snap.rollouts.items()},
        cluster_status={c.id: c.status for c in snap.clusters},
    )


def removal_reasons(snap: FleetSnapshot, result: PlacementResult) -> dict[str, str]:
    """Why each removed replica goes, for its event (`placement.explain`)."""
    _, pools, current = placement_inputs(snap)
    return explain_removals(current, pools, result, removal_context(snap))


def build_desired(snap: FleetSnapshot, assignments: list[AssignmentRow]) -> dict[str, DesiredState]:
    """Every known cluster's whole desired state (an empty list when it runs nothing);
    generation is left 0 for the publisher to set."""
    by_cluster: dict[str, list[ReplicaSpec]] = {c.id: [] for c in snap.clusters}
    deployments = {d.name: d for d in snap.deployments}
    for a in assignments:
        spec = snap.specs.get((a.deployment, a.version))
        if spec is None or a.cluster not in by_cluster:
            continue
        by_cluster[a.cluster].append(
            ReplicaSpec(
                replica_id=a.replica_id,
                deployment=a.deployment,
                version=a.version,
                model=spec.model,
                engine=spec.engine,
                engine_args=dict(spec.engine_args),
                resources=Resources(
                    gpu_models=list(spec.gpu_models),
                    gpu_count=spec.gpu_count,
                    gpu_memory_gb=spec.gpu_memory_gb,
                ),
                pool=a.pool,
                **_lora(deployments.get(a.deployment)),
            )
        )
    jurisdictions = {c.id: c.jurisdiction for c in snap.clusters}
    actions = node_actions(snap)
    return {
        cluster: DesiredState(
            cluster=cluster,
            replicas=sorted(specs, key=lambda r: r.replica_id),
            jurisdiction=jurisdictions.get(cluster, ""),
            node_actions=actions.get(cluster, []),
        )
        for cluster, specs in by_cluster.items()
    }


def node_actions(snap: FleetSnapshot) -> dict[str, list[NodeAction]]:
    """Each cluster's operator actions, the latest per node, in `at` order (the order the
    agent applies them in)."""
    out: dict[str, list[NodeAction]] = {}
    for n in snap.nodes:
        if n.action in ("cordon", "uncordon") and n.action_at is not None:
            action = NodeAction(node=n.node, action=n.action, at=n.action_at, reason=n.action_reason[:512])
            out.setdefault(n.cluster, []).append(action)
    return {c: sorted(a, key=lambda x: (x.at, x.node)) for c, a in out.items()}


def build_routes(
    snap: FleetSnapshot, assignments: list[AssignmentRow], pipelines: Sequence[PipelineSpec] = ()
) -> dict[str, RoutingTable]:
    """A routing table per deployment that wants replicas: its current version at full
    weight, and each cluster it is assigned to with that cluster's ready replicas.
    Unhealthy clusters are left out; deployments with zero replicas get no table, unless
    they may scale to zero (min_replicas 0): then gateways keep knowing them, hold their
    requests for a cold start and signal demand (`scale_to_zero`). A residency-bound
    deployment's table names its policy and leaves out clusters outside it (replicas that
    still run there while placement moves them get no more traffic). Each table names the
    pipelines its deployment is a step of, so a gateway routes their hops (the rest of the
    pipeline's steps' readiness it reads from their own tables)."""
    clusters = {c.id: c for c in snap.clusters}
    assigned: dict[str, dict[str, list[AssignmentRow]]] = defaultdict(lambda: defaultdict(list))
    for a in assignments:
        assigned[a.deployment][a.cluster].append(a)
    out: dict[str, RoutingTable] = {}
    for d in snap.deployments:
        spec = snap.specs.get((d.name, d.current_version))
        scale_to_zero = spec is not None and spec.min_replicas == 0
        if d.replicas <= 0 and not scale_to_zero:
            continue
        policy = residency.allowed(d.residency)
        routes = []
        for cluster_id, rows in sorted(assigned[d.name].items()):
            c = clusters.get(cluster_id)
            if c is None or c.status == ClusterStatus.unhealthy:
                continue
            if not residency.permits(policy, c.jurisdiction):
                continue
            routes.append(
                ClusterRoute(
                    cluster=c.id,
                    region=c.region,
                    gateway_url=c.gateway_url,
                    coordinates=c.coordinates,
                    replicas=sum(1 for a in rows if a.state == ReplicaState.ready.value),
                    healthy=True,
                    provider=c.provider,
                    standby=bool(spec and in_regions(c.region, spec.standby_regions)),
                    jurisdiction=c.jurisdiction,
                )
            )
        out[d.name] = RoutingTable(
            deployment=d.name,
            versions=version_weights(snap, d),
            clusters=routes,
            by_region=by_region_for(routes, snap.clusters),
            scale_to_zero=scale_to_zero,
            residency=None if d.residency is None else list(d.residency),
            shadow=shadow_target(snap, d),
            pipelines=[p for p in pipelines if d.name in p.deployments],
        )
    return out


def shadow_target(snap: FleetSnapshot, d: DeploymentRow) -> ShadowTarget | None:
    """The version gateways copy requests to during a rollout's shadow phase (its user
    weight is 0 in `version_weights`), or None."""
    rollout = snap.rollouts.get(d.name)
    if rollout is None or rollout.shadow_share is None or rollout.canary_version == d.current_version:
        return None
    return ShadowTarget(version=rollout.canary_version, share=rollout.shadow_share)


def build_keys(snap: FleetSnapshot) -> dict[str, ApiKeyRecord]:
    """Every key not revoked, as gateways verify it (salt and hash only)."""
    return {k.key_id: k for k in snap.keys}


def _lora(dep: DeploymentRow | None) -> dict:
    """A replica's LoRA fields from its deployment (none when it declares no adapters)."""
    if dep is None or not (dep.adapters or dep.max_adapters):
        return {}
    adapters = [LoRAAdapterSpec(name=n, uri=u) for n, u in dep.adapters]
    return {"adapters": adapters, "max_adapters": dep.max_adapters or DEFAULT_MAX_ADAPTERS}
