"""Co-placement of pipelines: in every cluster, either every step of a pipeline has a
replica or none does, so step-to-step calls never leave a cluster.

Pipelines that share a deployment are one unit (a `Group`): a cluster that holds the
shared step holds every step of both, or the shared step would split one of them. Steps
with no demand (count 0, or no demand at all) bind nothing. Pure: the placers call
`narrow` (each step's demand may only use the clusters where every step of its group can
run at all, and says why) and then keep the capacity part themselves (a binary per group
and cluster in the MILP, a repair pass in first-fit-decreasing); `splits` checks a plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand
from fleet_base.pipelines import PipelineSpec


@dataclass(frozen=True)
class Group:
    """Pipelines tied by shared steps: `deployments` (with demand) are all-or-none per
    cluster; `clusters` are those where every one of them can run."""

    pipelines: tuple[str, ...]
    deployments: tuple[str, ...]
    clusters: tuple[str, ...]
    steps: dict[str, str]  # deployment -> "step NAME (deployment D) of pipeline P"

    @property
    def label(self) -> str:
        return f"pipeline {', '.join(self.pipelines)}"

    def step(self, deployment: str) -> str:
        return self.steps[deployment]


def groups(
    pipelines: Sequence[PipelineSpec], demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]
) -> list[Group]:
    """The co-placement units, with the clusters each may use."""
    active = {d.deployment for d in demands if d.count > 0}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for p in pipelines:
        deps = [s.deployment for s in p.steps if s.deployment in active]
        for a in deps[1:]:
            parent[find(a)] = find(deps[0])
        for a in deps[:1]:
            find(a)
    members: dict[str, list[PipelineSpec]] = defaultdict(list)
    for p in pipelines:
        deps = [s.deployment for s in p.steps if s.deployment in active]
        if deps:
            members[find(deps[0])].append(p)
    out = []
    for specs in members.values():
        steps: dict[str, str] = {}
        for p in specs:
            for s in p.steps:
                if s.deployment in active:
                    steps.setdefault(
                        s.deployment, f"step {s.name} (deployment {s.deployment}) of pipeline {p.name}"
                    )
        if len(steps) < 2:
            continue  # one step with demand: nothing to keep together
        deps = tuple(sorted(steps))
        out.append(
            Group(
                pipelines=tuple(sorted(p.name for p in specs)),
                deployments=deps,
                clusters=_common_clusters(deps, demands, pools),
                steps=steps,
            )
        )
    return sorted(out, key=lambda g: g.pipelines)


def _host_clusters(
    deployment: str, demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]
) -> set[str]:
    return {
        p.cluster
        for d in demands
        if d.deployment == deployment and d.count > 0
        for p in pools
        if p.keeps_existing and d.acceptable(p)
    }


def _common_clusters(
    deps: Sequence[str], demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]
) -> tuple[str, ...]:
    common = {p.cluster for p in pools}
    for dep in deps:
        common &= _host_clusters(dep, demands, pools)
    return tuple(sorted(common))


def why_not(g: Group, demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]) -> str:
    """Per cluster outside the group's, the first step it cannot host and why."""
    from control_plane.placement.explain import rule_out

    out = []
    for cluster in sorted({p.cluster for p in pools} - set(g.clusters)):
        here = [p for p in pools if p.cluster == cluster and p.keeps_existing]
        for dep in g.deployments:
            ds = [d for d in demands if d.deployment == dep and d.count > 0]
            if not any(d.acceptable(p) for d in ds for p in here):
                reason = rule_out(ds[0], here) if ds else "no demand"
                reason = reason if isinstance(reason, str) else "not allowed there"
                out.append(f"{cluster} cannot host {g.step(dep)}: {reason}")
                break
    return "; ".join(out)


def narrow(
    demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity], pipelines: Sequence[PipelineSpec]
) -> tuple[list[ReplicaDemand], list[Group]]:
    """Each step's demand limited to its group's clusters (with why), and the groups."""
    if not pipelines:
        return list(demands), []
    found = groups(pipelines, demands, pools)
    by_dep = {dep: g for g in found for dep in g.deployments}
    whys = {g.pipelines: _why(g, demands, pools) for g in found}
    out = []
    for d in demands:
        g = by_dep.get(d.deployment)
        if g is None:
            out.append(d)
            continue
        out.append(d.model_copy(update={"clusters": g.clusters, "clusters_why": whys[g.pipelines]}))
    return out, found


def _why(g: Group, demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]) -> str:
    if g.clusters:
        why = f"{g.label}: its steps are placed together, only in cluster(s) {', '.join(g.clusters)}"
    else:
        why = f"{g.label}: no cluster can host every step"
    others = why_not(g, demands, pools)
    return why + (f" ({others})" if others else "")


def presence(g: Group, assignments: Iterable[Assignment]) -> dict[str, set[str]]:
    """cluster -> the group's deployments with a replica there."""
    out: dict[str, set[str]] = defaultdict(set)
    for a in assignments:
        if a.deployment in g.steps:
            out[a.cluster].add(a.deployment)
    return out


def splits(
    pipelines: Sequence[PipelineSpec], demands: Sequence[ReplicaDemand], assignments: Sequence[Assignment]
) -> list[str]:
    """Every cluster where a pipeline has some steps but not all (empty: none split).
    Steps without demand are not counted."""
    active = {d.deployment for d in demands if d.count > 0}
    where: dict[str, set[str]] = defaultdict(set)
    for a in assignments:
        where[a.deployment].add(a.cluster)
    problems = []
    for p in pipelines:
        deps = [s.deployment for s in p.steps if s.deployment in active]
        clusters = set().union(*(where[d] for d in deps)) if deps else set()
        for c in sorted(clusters):
            missing = [s.name for s in p.steps if s.deployment in active and c not in where[s.deployment]]
            if missing:
                problems.append(
                    f"pipeline {p.name} split in cluster {c}: no replica of step(s) {', '.join(missing)}"
                )
    return problems


def name_pipelines(result: PlacementResult, demands: Sequence[ReplicaDemand]) -> PlacementResult:
    """Every shortfall of a pipeline step says so: its pipeline and where its steps may go."""
    by_key = {d.key: d for d in demands}
    out = []
    changed = False
    for u in result.unplaced:
        d = by_key.get((u.deployment, u.version))
        if d is not None and d.clusters is not None and d.clusters_why and "pipeline " not in u.reason:
            u = u.model_copy(update={"reason": f"{u.reason}; {d.clusters_why}"})
            changed = True
        out.append(u)
    return result.model_copy(update={"unplaced": tuple(out)}) if changed else result
