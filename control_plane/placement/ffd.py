"""First-fit-decreasing placement: the first placer, and the greedy fallback of an
optimizing one.

Demands are placed biggest replica first; each replica goes to the most preferred pool
(reserved, then on-demand, then spot, then cheaper per GPU) that has a node with room,
spreading over new regions until the demand's `min_regions` is reached. Replicas that
already run where they are allowed stay put, so a re-plan after a small change moves
little: only replicas on unhealthy clusters or unknown pools, replicas of versions no
longer wanted, and the least preferred ones on scale-down are removed.
"""

from __future__ import annotations

import math
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from control_plane.placement.base import (
    PRIORITY_RANK,
    Assignment,
    PlacementResult,
    Placer,
    PoolCapacity,
    Preemption,
    ReplicaDemand,
    Unplaced,
    current_split,
    demands_by_key,
    register_placer,
)
from control_plane.placement.colocation import Group, name_pipelines, narrow, presence
from control_plane.placement.explain import add_note, explain_shortfall, residency_note, rule_out
from control_plane.placement.preempt import choose_victims, preemption
from control_plane.placement.quotas import (
    NO_QUOTAS,
    GpuQuotas,
    class_caps,
    preemptible,
    quota_reason,
    running_gpus,
)
from fleet_base.domain import Tier
from fleet_base.pipelines import PipelineSpec

MAX_REPLICA_ID = 63  # ReplicaAssignment.replica_id column width

IdFactory = Callable[[str, int], str]


def new_replica_id(deployment: str, version: int) -> str:
    """`<deployment>-v<version>-<6 hex>`, trimmed to fit the database column."""
    suffix = f"-v{version}-{secrets.token_hex(3)}"
    return deployment[: MAX_REPLICA_ID - len(suffix)] + suffix


class Shaped(Protocol):
    """What a new replica is made from: a replica or standby demand."""

    @property
    def deployment(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def gpu_count(self) -> int: ...


def fresh_assignment(
    d: Shaped, pool: PoolCapacity, node: int | None, used_ids: set[str], id_factory: IdFactory
) -> Assignment:
    """A new replica of `d` on `pool` (node `node`), under an id not in `used_ids` (added to it)."""
    replica_id = id_factory(d.deployment, d.version)
    while replica_id in used_ids:
        replica_id = id_factory(d.deployment, d.version)
    used_ids.add(replica_id)
    return Assignment(
        replica_id=replica_id,
        deployment=d.deployment,
        version=d.version,
        cluster=pool.cluster,
        pool=pool.name,
        gpus=d.gpu_count,
        node=node,
    )


class _Nodes:
    """Free GPUs per node of every pool, for first-fit within a pool."""

    def __init__(self, pools: Iterable[PoolCapacity]) -> None:
        self.free: dict[tuple[str, str], list[int]] = {p.key: [p.gpus_per_node] * p.nodes for p in pools}

    def first_fit(self, pool: PoolCapacity, gpus: int) -> int | None:
        for node, free in enumerate(self.free[pool.key]):
            if free >= gpus:
                return node
        return None

    def fits(self, pool_key: tuple[str, str], node: int, gpus: int) -> bool:
        free = self.free.get(pool_key, [])
        return 0 <= node < len(free) and free[node] >= gpus

    def take(self, pool_key: tuple[str, str], node: int, gpus: int) -> None:
        self.free[pool_key][node] -= gpus

    def give_back(self, pool_key: tuple[str, str], node: int, gpus: int) -> None:
        self.free[pool_key][node] += gpus


@dataclass
class _Plan:
    """The state the greedy passes share: the inputs by key, free GPUs per node, the
    replicas kept, added and removed so far, and the GPUs each class holds against its quota."""

    by_demand: dict[tuple[str, int], ReplicaDemand]
    pools: list[PoolCapacity]  # preference order
    quotas: GpuQuotas
    id_factory: IdFactory
    used_ids: set[str]
    by_pool: dict[tuple[str, str], PoolCapacity] = field(init=False)
    nodes: _Nodes = field(init=False)
    candidates: dict[tuple[str, int], list[Assignment]] = field(default_factory=lambda: defaultdict(list))
    kept: list[Assignment] = field(default_factory=list)
    added: list[Assignment] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    placed: dict[tuple[str, int], list[Assignment]] = field(default_factory=lambda: defaultdict(list))
    unplaced: dict[tuple[str, int], Unplaced] = field(default_factory=dict)
    preempted: list[Preemption] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    budget: dict[int, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    groups: list[Group] = field(default_factory=list)  # pipelines to co-place
    group_of: dict[str, Group] = field(init=False)

    def __post_init__(self) -> None:
        self.by_pool = {p.key: p for p in self.pools}
        self.nodes = _Nodes(self.pools)
        self.group_of = {dep: g for g in self.groups for dep in g.deployments}

    def demand_of(self, a: Assignment) -> ReplicaDemand:
        return self.by_demand[(a.deployment, a.version)]

    def rank_of(self, a: Assignment) -> int:
        return self.demand_of(a).rank

    def screen(self, current: Sequence[Assignment]) -> None:
        """Which current replicas may stay: right version, allowed pool, cluster not lost."""
        ok, self.removed = current_split(current, self.by_demand, self.by_pool)
        for a in ok:
            self.candidates[(a.deployment, a.version)].append(a)

    def scale_down(self) -> list[Assignment]:
        """Keep the best replica per region up to min_regions, then the most preferred."""
        keep: list[Assignment] = []
        for key, group in self.candidates.items():
            count = self.by_demand[key].count
            chosen = _keep_order(group, self.by_demand[key], self.by_pool)
            keep += chosen[:count]
            self.removed += [a.replica_id for a in chosen[count:]]
        return keep

    def fit_survivors(self, keep: list[Assignment]) -> None:
        """Fit the survivors onto nodes: their recorded node first, then first-fit, largest first."""
        unfitted: list[Assignment] = []
        for a in sorted(keep, key=lambda a: (self.by_pool[a.pool_key].preference(), a.replica_id)):
            if a.node is not None and self.nodes.fits(a.pool_key, a.node, a.gpus):
                self.nodes.take(a.pool_key, a.node, a.gpus)
                self.kept.append(a)
            else:
                unfitted.append(a)
        for a in sorted(
            unfitted, key=lambda a: (-a.gpus, self.by_pool[a.pool_key].preference(), a.replica_id)
        ):
            node = self.nodes.first_fit(self.by_pool[a.pool_key], a.gpus)
            if node is None:
                self.removed.append(a.replica_id)
                continue
            self.nodes.take(a.pool_key, node, a.gpus)
            self.kept.append(a if a.node == node else a.model_copy(update={"node": node}))

    def open_quotas(self) -> None:
        """What each class holds after the survivors, its caps and its preemptible budget."""
        for a in self.kept:
            self.placed[(a.deployment, a.version)].append(a)
        running = running_gpus(self.by_demand.values(), {k: len(g) for k, g in self.candidates.items()})
        self.caps = class_caps(self.quotas, running)
        self.budget = {PRIORITY_RANK[c]: n for c, n in preemptible(self.quotas, running).items()}
        for a in self.kept:
            self.held[self.demand_of(a).priority] += a.gpus

    def place_missing(self) -> None:
        """Place what is missing, the highest class first; within it the narrowest
        residency first (a bound demand has fewer places to go than one without a policy),
        then biggest replicas first. Class floors (quotas) are placed first; class bounds
        stop a class's growth."""
        order = sorted(
            self.by_demand.values(),
            key=lambda d: (
                -d.rank,
                _residency_width(d),
                -d.gpu_count,
                -d.gpu_memory_gb,
                -(d.count - len(self.placed[d.key])),
                d.deployment,
                d.version,
            ),
        )
        for d in order:  # floors first: each floored class up to its guaranteed GPUs
            floor = self.quotas.floor(d.priority)
            while len(self.placed[d.key]) < d.count and self.held[d.priority] < floor:
                if self.place_one(d) is not None:
                    break
        for d in order:
            while len(self.placed[d.key]) < d.count:
                why = self.place_one(d)
                if why is not None:
                    self.unplaced[d.key] = Unplaced(
                        deployment=d.deployment,
                        version=d.version,
                        missing=d.count - len(self.placed[d.key]),
                        reason=why,
                    )
                    break

    def place_one(self, d: ReplicaDemand) -> str | None:
        """Place one replica of `d`; None, or why not. A replica that finds no free node
        may preempt replicas of strictly lower classes."""
        cap = self.caps.get(d.priority)
        if cap is not None and self.held[d.priority] + d.gpu_count > cap:
            return quota_reason(d.priority, self.quotas, self.held[d.priority])
        covered = {self.by_pool[a.pool_key].region for a in self.placed[d.key]}
        pools = self.pools
        g = self.group_of.get(d.deployment)
        if g is not None:  # a pipeline step: the clusters its pipeline already uses first
            home = set(presence(g, self.kept + self.added))
            pools = sorted(pools, key=lambda p: p.cluster not in home)
        spot = _choose(d, pools, self.nodes, covered)
        if spot is None and d.rank > 0:
            spot = self.preempt_for(d)
        if spot is None:
            return _why(d, self.pools)
        new = self.assign(d, *spot)
        self.placed[d.key].append(new)
        self.added.append(new)
        self.held[d.priority] += d.gpu_count
        return None

    def preempt_for(self, d: ReplicaDemand) -> tuple[PoolCapacity, int] | None:
        """Free a node for `d` by preempting lower classes within their budget; the spot, or None."""
        choice = choose_victims(
            d, self.pools, self.nodes.free, self.kept + self.added, self.rank_of, self.budget
        )
        if choice is None:
            return None
        pool, node, victims = choice
        for v in victims:
            self.placed[(v.deployment, v.version)].remove(v)
            self.nodes.give_back(v.pool_key, v.node, v.gpus)
            self.held[self.demand_of(v).priority] -= v.gpus
            if self.rank_of(v) in self.budget:
                self.budget[self.rank_of(v)] -= v.gpus
            if v in self.added:  # placed earlier in this plan: never ran
                self.added.remove(v)
                continue
            self.kept.remove(v)
            self.removed.append(v.replica_id)
            self.preempted.append(preemption(v, self.demand_of(v), d))
        return pool, node

    def spread(self, d: ReplicaDemand) -> None:
        """Move surplus replicas of `d` into new regions until min_regions (when capacity allows)."""
        group = self.placed[d.key]
        for _ in range(len(group)):  # each move covers one more region
            regions = defaultdict(list)
            for a in group:
                regions[self.by_pool[a.pool_key].region].append(a)
            if len(regions) >= min(d.min_regions, len(group)):
                break
            spot = _choose(d, self.pools, self.nodes, set(regions), new_region_only=True)
            crowded = [a for r in regions.values() if len(r) > 1 for a in r]
            if spot is None or not crowded:
                break
            victim = max(crowded, key=lambda a: (self.by_pool[a.pool_key].preference(), a.replica_id))
            group.remove(victim)
            self.nodes.give_back(victim.pool_key, victim.node, victim.gpus)
            if victim in self.added:
                self.added.remove(victim)
            else:
                self.kept.remove(victim)
                self.removed.append(victim.replica_id)
            new = self.assign(d, *spot)
            group.append(new)
            self.added.append(new)
        n_regions = len({self.by_pool[a.pool_key].region for a in group})
        if n_regions < min(d.min_regions, d.count):
            add_note(
                self.unplaced, d.key, d, f"only {n_regions} of min_regions {d.min_regions} regions have room"
            )

    def co_place(self, g: Group) -> None:
        """Repair splits of a pipeline group: a cluster holding some of its steps gets the
        missing ones (a replica still short, else one moved from a cluster holding more
        than one of that step), else loses the ones it has; then the short replicas go to
        clusters holding every step. Each pass settles one cluster (a move leaves its
        source cluster with the step), so the repair ends."""
        demands = [d for d in self.by_demand.values() if d.deployment in g.steps and d.count > 0]
        notes: list[str] = []
        while True:
            where = presence(g, self.kept + self.added)
            partial = [c for c, deps in where.items() if len(deps) < len(g.deployments)]
            if not partial:
                break
            pool_rank = {p.cluster: i for i, p in reversed(list(enumerate(self.pools)))}
            c = min(partial, key=lambda c: (-len(where[c]), pool_rank.get(c, 0), c))
            missing = [dep for dep in g.deployments if dep not in where[c]]
            added: list[Assignment] = []
            here = [p for p in self.pools if p.cluster == c]
            for dep in missing:
                new = self._add_short(dep, here) or self._move_in(dep, here)
                if new is None:
                    notes.append(f"cluster {c} has no room for {g.step(dep)}")
                    break
                added.append(new)
            else:
                continue
            for a in added + [
                a for a in self.kept + self.added if a.cluster == c and a.deployment in g.steps
            ]:
                self._drop(a)
        complete = [
            c for c, deps in presence(g, self.kept + self.added).items() if len(deps) == len(g.deployments)
        ]
        for d in demands:
            while len(self.placed[d.key]) < d.count:
                if self._add_short(d.deployment, [p for p in self.pools if p.cluster in complete]) is None:
                    break
        for d in demands:
            missing = d.count - len(self.placed[d.key])
            prior = self.unplaced.get(d.key)
            if prior is not None and (prior.missing > 0 or missing > 0):
                del self.unplaced[d.key]  # its count changed here: said again below
            if missing > 0:
                why = _why(d, self.pools)
                if g.clusters:
                    where_ok = ", ".join(complete) or "none"
                    why = (
                        f"{g.label}: steps are placed together and the clusters holding every step "
                        f"({where_ok}) have no room for {missing} more of {g.step(d.deployment)}"
                        + (f"; {'; '.join(dict.fromkeys(notes))}" if notes else "")
                        + f"; {why}"
                    )
                self.unplaced[d.key] = Unplaced(
                    deployment=d.deployment, version=d.version, missing=missing, reason=why
                )

    def _add_short(self, deployment: str, pools: list[PoolCapacity]) -> Assignment | None:
        """A new replica of a version of `deployment` still short of its count, on `pools`."""
        for d in self.by_demand.values():
            if d.deployment != deployment or len(self.placed[d.key]) >= d.count:
                continue
            spot = _choose(d, pools, self.nodes, set())
            if spot is None:
                continue
            new = self.assign(d, *spot)
            self.placed[d.key].append(new)
            self.added.append(new)
            self.held[d.priority] += d.gpu_count
            return new
        return None

    def _move_in(self, deployment: str, pools: list[PoolCapacity]) -> Assignment | None:
        """One replica of `deployment` moved onto `pools` from a cluster that holds more
        than one of it (new replicas before running ones), so a partial cluster gets the
        step without dropping anything and the source cluster keeps it."""
        mine = [a for a in self.added + self.kept if a.deployment == deployment]
        per_cluster: dict[str, int] = defaultdict(int)
        for a in mine:
            per_cluster[a.cluster] += 1
        targets = {p.cluster for p in pools}
        for a in mine:
            if a.cluster in targets or per_cluster[a.cluster] < 2:
                continue
            d = self.demand_of(a)
            spot = _choose(d, pools, self.nodes, set())
            if spot is None:
                continue
            self._drop(a)
            new = self.assign(d, *spot)
            self.placed[d.key].append(new)
            self.added.append(new)
            self.held[d.priority] += d.gpu_count
            return new
        return None

    def _drop(self, a: Assignment) -> None:
        self.placed[(a.deployment, a.version)].remove(a)
        if a.node is not None:
            self.nodes.give_back(a.pool_key, a.node, a.gpus)
        self.held[self.demand_of(a).priority] -= a.gpus
        if a in self.added:
            self.added.remove(a)
        else:
            self.kept.remove(a)
            self.removed.append(a.replica_id)

    def result(self) -> PlacementResult:
        """The plan, an unplaced demand that was preempted saying by whom."""
        for key, by in sorted({(p.deployment, p.version): p for p in self.preempted}.items()):
            if key in self.unplaced:
                add_note(
                    self.unplaced,
                    key,
                    self.by_demand[key],
                    f"preempted by {by.by_deployment} ({by.by_priority})",
                )
        return PlacementResult(
            kept=tuple(self.kept),
            added=tuple(self.added),
            removed=tuple(self.removed),
            unplaced=tuple(self.unplaced[k] for k in sorted(self.unplaced)),
            preempted=tuple(self.preempted),
        )

    def assign(self, d: ReplicaDemand, pool: PoolCapacity, node: int) -> Assignment:
        self.nodes.take(pool.key, node, d.gpu_count)
        return fresh_assignment(d, pool, node, self.used_ids, self.id_factory)


class FirstFitDecreasing(Placer):
    name = "ffd"

    def __init__(self, id_factory: IdFactory = new_replica_id, quotas: GpuQuotas = NO_QUOTAS) -> None:
        self._id_factory = id_factory
        self.quotas = quotas

    def place(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        pipelines: Sequence[PipelineSpec] = (),
    ) -> PlacementResult:
        demands, groups = narrow(demands, pools, pipelines)
        by_demand = demands_by_key(demands)
        plan = _Plan(
            by_demand=by_demand,
            pools=sorted({p.key: p for p in pools}.values(), key=PoolCapacity.preference),
            quotas=self.quotas,
            id_factory=self._id_factory,
            used_ids={a.replica_id for a in current},
            groups=groups,
        )
        plan.screen(current)
        plan.fit_survivors(plan.scale_down())
        plan.open_quotas()
        plan.place_missing()
        for d in by_demand.values():
            plan.spread(d)
        for g in groups:
            plan.co_place(g)
        return name_pipelines(plan.result(), demands)


def _choose(
    d: ReplicaDemand,
    pools: Sequence[PoolCapacity],
    nodes: _Nodes,
    covered: set[str],
    new_region_only: bool = False,
) -> tuple[PoolCapacity, int] | None:
    """The most preferred pool with a node that fits, in a new region first while
    the demand spans fewer than min_regions. `pools` is in preference order."""
    spread = len(covered) < d.min_regions
    fallback: tuple[PoolCapacity, int] | None = None
    for pool in pools:
        if not pool.accepts_new or not d.acceptable(pool):
            continue
        node = nodes.first_fit(pool, d.gpu_count)
        if node is None:
            continue
        if pool.region not in covered or not spread:
            return pool, node
        if fallback is None and not new_region_only:
            fallback = (pool, node)
    return fallback


def _residency_width(d: ReplicaDemand) -> float:
    """How many jurisdictions the demand may use (no policy: any)."""
    return math.inf if d.residency is None else len(set(d.residency))


def keep_rank(a: Assignment, by_pool: Mapping[tuple[str, str], PoolCapacity]) -> tuple:
    """Which of a demand's running replicas to keep first: those that serve, then by pool
    preference (the placers' scale-down and the standby's warm minimum share it)."""
    return (not a.ready, by_pool[a.pool_key].preference(), a.replica_id)


def _keep_order(
    group: list[Assignment], d: ReplicaDemand, by_pool: dict[tuple[str, str], PoolCapacity]
) -> list[Assignment]:
    """Current replicas of one demand, best kept first: the most preferred one in each
    region until min_regions regions are covered, then by pool preference; those that
    serve before those still starting, at each step (`Assignment.ready`)."""
    ranked = sorted(group, key=lambda a: keep_rank(a, by_pool))
    first: list[Assignment] = []
    regions: set[str] = set()
    for a in ranked:
        region = by_pool[a.pool_key].region
        if len(regions) < d.min_regions and region not in regions:
            regions.add(region)
            first.append(a)
    return first + [a for a in ranked if a not in first]


def _why(d: ReplicaDemand, pools: Sequence[PoolCapacity]) -> str:
    """Name the first constraint that rules out every pool."""
    left = rule_out(d, pools, labelled=False)
    if isinstance(left, str):
        return left
    return (
        f"no free node with {d.gpu_count} GPUs in the {len(left)} matching pool(s)"
        f"{residency_note(d, pools, left)}"
    )


register_placer(FirstFitDecreasing.name, FirstFitDecreasing)


def spot_safe_ffd(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    current: Sequence[Assignment] = (),
    id_factory: IdFactory = new_replica_id,
    quotas: GpuQuotas = NO_QUOTAS,
    pipelines: Sequence[PipelineSpec] = (),
) -> PlacementResult:
    """First-fit-decreasing as the fallback of a placer that keeps every hard rule: FFD
    does not know max_spot_fraction, so surplus spot replicas (newest first, then those
    still starting) are dropped and reported as unplaced."""
    result = FirstFitDecreasing(id_factory, quotas).place(demands, pools, current, pipelines)
    by_pool = {p.key: p for p in pools}
    by_demand = {d.key: d for d in demands}
    drop: set[str] = set()
    notes: dict[tuple, int] = {}
    new = {a.replica_id for a in result.added}
    for dk, d in by_demand.items():
        mine = [
            a
            for a in result.added + result.kept
            if (a.deployment, a.version) == dk and by_pool[a.pool_key].tier == Tier.spot
        ]
        spot = sorted(mine, key=lambda a: (a.replica_id not in new, a.ready))  # new, starting, ready
        extra = len(spot) - d.max_spot
        if extra > 0:
            drop |= {a.replica_id for a in spot[:extra]}
            notes[dk] = extra
    drop |= _unsplit(result.added + result.kept, drop, demands, pools, pipelines, notes)
    if not drop:
        return result
    unplaced = {(u.deployment, u.version): u for u in result.unplaced}
    for dk, n in notes.items():
        d = by_demand[dk]
        prior = unplaced.get(dk)
        unplaced[dk] = Unplaced(
            deployment=d.deployment,
            version=d.version,
            missing=(prior.missing if prior else 0) + n,
            reason=explain_shortfall(d, pools),
        )
    safe = PlacementResult(
        kept=tuple(a for a in result.kept if a.replica_id not in drop),
        added=tuple(a for a in result.added if a.replica_id not in drop),
        removed=result.removed + tuple(a.replica_id for a in result.kept if a.replica_id in drop),
        unplaced=tuple(unplaced[k] for k in sorted(unplaced)),
    )
    return name_pipelines(safe, narrow(demands, pools, pipelines)[0]) if pipelines else safe


def _unsplit(
    assignments: Sequence[Assignment],
    drop: set[str],
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    pipelines: Sequence[PipelineSpec],
    notes: dict[tuple, int],
) -> set[str]:
    """Replicas to drop as well so that dropping spot replicas splits no pipeline: every
    step's replicas in a cluster the drop left partial (counted in `notes`)."""
    if not pipelines:
        return set()
    _, found = narrow(demands, pools, pipelines)
    more: set[str] = set()
    for g in found:
        left = [a for a in assignments if a.replica_id not in drop | more]
        where = presence(g, left)
        for a in left:
            if a.deployment in g.steps and len(where[a.cluster]) < len(g.deployments):
                more.add(a.replica_id)
                notes[(a.deployment, a.version)] = notes.get((a.deployment, a.version), 0) + 1
    return more
