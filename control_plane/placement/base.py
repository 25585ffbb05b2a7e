"""The placement problem and its answer, independent of any algorithm.

A placer turns replica demands, capacity pools and the current assignment into a new
assignment. Placers are pure and synchronous (no database, no I/O), so the live
reconcile loop, `fleetctl plan` and `fleetctl simulate` run the same code, and a
better placer replaces first-fit-decreasing by registering under a name.
"""

from __future__ import annotations

import fnmatch
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet_base import residency
from fleet_base.domain import TIER_ORDER, ClusterStatus, Coordinates, PoolShape
from fleet_base.named_registry import Registry
from fleet_base.pipelines import PipelineSpec


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# A deployment's class: a higher one may preempt replicas of a strictly lower one to place
# its demand, never the reverse (docs/placement.md, "Priorities").
PriorityClass = Literal["critical", "standard", "batch"]
PRIORITY_RANK: dict[str, int] = {"batch": 0, "standard": 1, "critical": 2}


class PoolCapacity(PoolShape, _Frozen):
    """A cluster's pool as the placer sees it. `hourly_price` is per node (what a
    provider sells), so the price of one GPU is `hourly_price / gpus_per_node`."""

    cluster: str
    name: str
    region: str = ""
    cluster_status: ClusterStatus = ClusterStatus.healthy
    coordinates: Coordinates = Field(default_factory=Coordinates)
    provider: str = ""  # with `region`, finds measured latencies (control_plane.geo)
    # The legal home of the pool's data (`ca`, `us`); "" is outside every residency policy.
    jurisdiction: str = ""
    # $ per node-hour the pool's record of node faults adds in the plan (never to what is
    # paid): control_plane.placement.reliability.
    reliability_premium: float = Field(0.0, ge=0, allow_inf_nan=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.cluster, self.name)

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def accepts_new(self) -> bool:
        """Only healthy clusters get new replicas."""
        return self.cluster_status == ClusterStatus.healthy

    @property
    def keeps_existing(self) -> bool:
        """A draining cluster (operator cordon) keeps serving what it runs; an
        unhealthy one loses its replicas to re-placement."""
        return self.cluster_status in (ClusterStatus.healthy, ClusterStatus.draining)

    @property
    def price_per_gpu(self) -> float:
        return self.hourly_price / self.gpus_per_node

    @property
    def planned_price_per_gpu(self) -> float:
        """The price per GPU the plan weighs: what is paid plus the reliability premium."""
        return (self.hourly_price + self.reliability_premium) / self.gpus_per_node

    def preference(self) -> tuple:
        """Lower is better: reserved, then on-demand, then spot; then cheaper (failures
        priced in)."""
        return (TIER_ORDER[self.tier], self.planned_price_per_gpu, self.cluster, self.name)


class ReplicaDemand(_Frozen):
    """`count` replicas of one deployment version, each needing `gpu_count` GPUs of one
    node. `gpu_models` and `regions` empty mean any; regions may be glob patterns.
    `residency` (None: no policy) narrows the allowed regions to pools whose jurisdiction
    it names, fail-closed (`fleet_base.residency`)."""

    deployment: str
    version: int = Field(ge=0)
    count: int = Field(ge=0)
    gpu_models: tuple[str, ...] = ()
    gpu_count: int = Field(1, ge=1)
    gpu_memory_gb: float = Field(0.0, ge=0)
    regions: tuple[str, ...] = ()
    min_regions: int = Field(1, ge=0)
    # At most this share of the replicas on spot pools (1.0: no limit). FFD ignores it.
    max_spot_fraction: float = Field(1.0, ge=0, le=1)
    # Where requests come from: region -> share (weights, need not sum to 1); the
    # optimizing placer prefers pools near it once cost and moves are settled.
    demand_regions: dict[str, float] = Field(default_factory=dict)
    priority: PriorityClass = "standard"
    residency: tuple[str, ...] | None = None
    # The clusters a pipeline step may use (None: any): those where every step of its
    # pipelines can run (control_plane.placement.colocation), and why, for shortfalls.
    clusters: tuple[str, ...] | None = None
    clusters_why: str = ""

    @property
    def rank(self) -> int:
        return PRIORITY_RANK[self.priority]

    @property
    def max_spot(self) -> int:
        """How many replicas may run on spot."""
        return math.floor(self.max_spot_fraction * self.count + 1e-9)

    @property
    def key(self) -> tuple[str, int]:
        return (self.deployment, self.version)

    def model_ok(self, pool: PoolCapacity) -> bool:
        if not self.gpu_models:
            return True
        return pool.gpu_model.lower() in {m.lower() for m in self.gpu_models}

    def memory_ok(self, pool: PoolCapacity) -> bool:
        return pool.gpu_memory_gb >= self.gpu_memory_gb

    def region_ok(self, pool: PoolCapacity) -> bool:
        if not self.regions:
            return True
        return any(fnmatch.fnmatchcase(pool.region, pattern) for pattern in self.regions)

    def residency_ok(self, pool: PoolCapacity) -> bool:
        """The pool's jurisdiction is one the policy names (always, with no policy)."""
        return residency.permits(residency.allowed(self.residency), pool.jurisdiction)

    def allowed_region(self, pool: PoolCapacity) -> bool:
        """Where the demand may run: its allowed regions, narrowed by its residency."""
        return self.region_ok(pool) and self.residency_ok(pool)

    def cluster_ok(self, pool: PoolCapacity) -> bool:
        return self.clusters is None or pool.cluster in self.clusters

    def shape_ok(self, pool: PoolCapacity) -> bool:
        """A replica never spans nodes."""
        return self.gpu_count <= pool.gpus_per_node

    def acceptable(self, pool: PoolCapacity) -> bool:
        """Every static constraint (not health, not free room)."""
        return (
            self.model_ok(pool)
            and self.memory_ok(pool)
            and self.allowed_region(pool)
            and self.shape_ok(pool)
            and self.cluster_ok(pool)
        )


class Assignment(_Frozen):
    """One replica on one pool. `node` (index within the pool) is the placer's own
    bookkeeping; it may be None when the caller does not store it, and is then
    reconstructed. `ready`: its agent last reported it serving (a caller that does not know
    says nothing, and the replica counts as serving: it is never traded away for not being
    known). A scale-down stops the replicas still starting before those that serve, as a
    Kubernetes ReplicaSet deletes unready pods first: trading a warm replica for one that
    may not come up is capacity lost now for a preference later."""

    replica_id: str
    deployment: str
    version: int
    cluster: str
    pool: str
    gpus: int = Field(1, ge=1)
    node: int | None = None
    ready: bool = True

    @property
    def pool_key(self) -> tuple[str, str]:
        return (self.cluster, self.pool)


CurrentAssignment = Assignment


class Unplaced(_Frozen):
    """A demand not fully met: `missing` replicas could not be placed (0 when all were
    placed but a soft constraint, like min_regions, could not be met) and why."""

    deployment: str
    version: int
    missing: int
    reason: str


class Preemption(_Frozen):
    """A running replica removed so that a demand of a strictly higher class fits; its
    id is also in `PlacementResult.removed`."""

    replica_id: str
    deployment: str
    version: int
    priority: PriorityClass
    by_deployment: str
    by_version: int
    by_priority: PriorityClass
    reason: str


class PlacementResult(_Frozen):
    kept: tuple[Assignment, ...] = ()
    added: tuple[Assignment, ...] = ()
    removed: tuple[str, ...] = ()  # replica ids of the current assignment no longer wanted
    unplaced: tuple[Unplaced, ...] = ()
    preempted: tuple[Preemption, ...] = ()

    @property
    def assignments(self) -> tuple[Assignment, ...]:
        """The whole new assignment (feed it back as `current` next time)."""
        return self.kept + self.added

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


class SolveInfo(BaseModel):
    """How a plan was found, for `fleetctl plan`, the loop and the benchmark."""

    model_config = ConfigDict(frozen=True)

    method: str  # "milp-optimal", "milp-time-limit", "milp-gap", "greedy-huge", "greedy-error", "unchanged"
    cost: float  # $/hour of the plan (evaluate.plan_cost)
    lp_bound: float | None = None  # $/hour: no plan placing every replica costs less
    mip_bound: float | None = None  # the solver's own dual bound on the weighted objective
    solve_s: float = 0.0  # placing, without the LP bound
    lp_s: float = 0.0  # solving the LP relaxation for the bound
    variables: int = 0
    note: str = ""


class SolvedPlan(_Frozen):
    """The last plan a placer made, handed back to it on the next pass (the warm start,
    passed in rather than kept on the placer): the fingerprint of its inputs and of the
    assignment it produced, its shortfalls and how it was found."""

    inputs: int
    assignments: int
    unplaced: tuple[Unplaced, ...] = ()
    info: SolveInfo

    def matches(self, inputs: int, current: Sequence[Assignment], lp_bound: bool = False) -> bool:
        """Same inputs and the caller runs exactly this plan (and has its LP bound if asked)."""
        return (
            self.inputs == inputs
            and self.assignments == fingerprint_assignments(current)
            and (not lp_bound or self.info.lp_bound is not None)
        )


def fingerprint_inputs(
    demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity], extra: object = None
) -> int:
    d = tuple(
        (x.deployment, x.version, x.count, x.gpu_models, x.gpu_count, x.gpu_memory_gb, x.regions,
         x.min_regions, x.max_spot_fraction, tuple(sorted(x.demand_regions.items())), x.priority,
         x.residency, x.clusters)
        for x in demands
    )  # fmt: skip
    p = tuple(
        (x.cluster, x.name, x.region, x.provider, x.gpu_model, x.gpu_memory_gb, x.gpus_per_node, x.nodes,
         x.tier, x.hourly_price, x.cluster_status, x.jurisdiction, x.reliability_premium)
        for x in pools
    )  # fmt: skip
    return hash((d, p, extra))


def fingerprint_assignments(assignments: Sequence[Assignment]) -> int:
    return hash(
        tuple(
            sorted(
                (a.replica_id, a.deployment, a.version, a.cluster, a.pool, a.gpus, a.node)
                for a in assignments
            )
        )
    )


def demands_by_key(demands: Sequence[ReplicaDemand]) -> dict[tuple[str, int], ReplicaDemand]:
    """Demands by (deployment, version); ValueError on a second demand for one version."""
    out: dict[tuple[str, int], ReplicaDemand] = {}
    for d in demands:
        if d.key in out:
            raise ValueError(f"duplicate demand for {d.deployment} v{d.version}")
        out[d.key] = d
    return out


def current_split(
    current: Sequence[Assignment],
    by_demand: Mapping[tuple[str, int], ReplicaDemand],
    by_pool: Mapping[tuple[str, str], PoolCapacity],
) -> tuple[list[Assignment], list[str]]:
    """Current replicas that may stay (right version and shape, allowed pool, cluster not
    lost), in order, and the ids of those that must go; a repeated id counts once."""
    ok: list[Assignment] = []
    gone: list[str] = []
    seen: set[str] = set()
    for a in current:
        if a.replica_id in seen:
            continue
        seen.add(a.replica_id)
        d, p = by_demand.get((a.deployment, a.version)), by_pool.get(a.pool_key)
        if d is None or p is None or not p.keeps_existing or not d.acceptable(p) or a.gpus != d.gpu_count:
            gone.append(a.replica_id)
        else:
            ok.append(a)
    return ok, gone


class Placer(ABC):
    """Places replica demands onto pools, given what runs now. Pure and stateless: same
    inputs, same decisions (up to fresh replica ids); what it needs of the last plan
    comes in as `previous`."""

    name: str = ""

    @abstractmethod
    def place(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        pipelines: Sequence[PipelineSpec] = (),
    ) -> PlacementResult:
        """`pipelines`: every step of each has a replica in a cluster, or none does."""

    def solve(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        lp_bound: bool = False,
        previous: SolvedPlan | None = None,
        pipelines: Sequence[PipelineSpec] = (),
    ) -> tuple[PlacementResult, SolveInfo | None]:
        """The plan and how it was found (None: the placer does not say)."""
        if not pipelines:  # a placer written before pipelines keeps its signature
            return self.place(demands, pools, current), None
        return self.place(demands, pools, current, pipelines), None


PlacerFactory = Callable[[], Placer]
PLACERS: Registry[Placer] = Registry("placer")


def register_placer(name: str, factory: PlacerFactory) -> None:
    PLACERS.register(name, factory)


def get_placer(name: str) -> Placer:
    """A placer by name (the process's default: `Settings.placer`); ValueError lists the known ones."""
    return PLACERS.make(name)


def placer_names() -> list[str]:
    return PLACERS.names()
