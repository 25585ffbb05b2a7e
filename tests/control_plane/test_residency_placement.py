"""Data residency in placement: a residency-bound deployment's replicas go only to pools
whose jurisdiction its policy names (narrowing its allowed regions), fail-closed, in both
placers and every path around them (current replicas, standby, the snapshot's inputs,
catalogs, `fleetctl plan`); demand it cannot place is reported with a reason naming
residency, never placed elsewhere."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from control_plane.catalog import CatalogError, offers_to_pools, parse_catalog
from control_plane.fleet_model.plan import placement_inputs
from control_plane.fleet_model.snapshot import ClusterRow, DeploymentRow, FleetSnapshot, PoolRow, VersionSpec
from control_plane.placement import Assignment, FirstFitDecreasing, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import violations
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.offline import DemandsFile, plan
from control_plane.placement.pipeline import PlacementInputs, run
from control_plane.placement.standby import StandbyDemand
from fleet_base import residency
from fleet_base.domain import ClusterStatus, Tier

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
PLACERS = {"ffd": FirstFitDecreasing(), "milp": MilpPlacer(time_limit_s=5, mip_gap=0.0)}


def pool(
    cluster: str, jurisdiction: str, region: str = "", price: float = 1.0, nodes: int = 4
) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster,
        name="p",
        region=region or cluster,
        jurisdiction=jurisdiction,
        gpu_model="h100",
        gpus_per_node=1,
        nodes=nodes,
        tier=Tier.on_demand,
        hourly_price=price,
    )


def demand(
    name: str, count: int, policy: tuple[str, ...] | None, regions: tuple[str, ...] = ()
) -> ReplicaDemand:
    return ReplicaDemand(deployment=name, version=1, count=count, residency=policy, regions=regions)


def where(result, pools: list[PoolCapacity], name: str) -> Counter:
    by_pool = {p.key: p for p in pools}
    return Counter(by_pool[a.pool_key].cluster for a in result.assignments if a.deployment == name)


def unplaced(result, name: str):
    return next((u for u in result.unplaced if u.deployment == name), None)


# ---------------------------------------------------------------- the policy, table-driven

CA1, CA2 = pool("ca-east", "ca", price=3.0), pool("ca-west", "ca", price=2.0)
US = pool("us-east", "us", price=0.5)  # cheapest: placement would go there without a policy
BARE = pool("nowhere", "", price=0.1)  # no jurisdiction: outside every policy

CASES = [
    # (case, pools, demands, {deployment: {cluster: replicas}}, {deployment: (missing, reason part)})
    ("no policy takes the cheapest", [CA1, US], [demand("a", 2, None)], {"a": {"us-east": 2}}, {}),
    ("policy keeps it home", [CA1, CA2, US], [demand("a", 3, ("ca",))], {"a": {"ca-west": 3}}, {}),
    (
        "residency narrows the allowed regions",
        [CA1, CA2, US],
        [demand("a", 2, ("ca",), regions=("ca-east", "us-east"))],
        {"a": {"ca-east": 2}},
        {},
    ),
    (
        "regions and residency share nothing",
        [CA1, CA2, US],
        [demand("a", 2, ("ca",), regions=("us-east",))],
        {"a": {}},
        {"a": (2, "residency")},
    ),
    ("no permitted pool", [CA1, US], [demand("a", 2, ("eu",))], {"a": {}}, {"a": (2, "residency eu")}),
    (
        "an empty policy allows nothing",
        [CA1, US],
        [demand("a", 1, ())],
        {"a": {}},
        {"a": (1, "residency none")},
    ),
    (
        "a pool without jurisdiction is refused",
        [BARE],
        [demand("a", 1, ("ca",))],
        {"a": {}},
        {"a": (1, "residency")},
    ),
    (
        "a pool without jurisdiction serves no policy",
        [BARE],
        [demand("a", 1, None)],
        {"a": {"nowhere": 1}},
        {},
    ),
    (
        "short of room at home, never placed abroad",
        [pool("ca-east", "ca", nodes=2), US],
        [demand("a", 3, ("ca",))],
        {"a": {"ca-east": 2}},
        {"a": (1, "residency ca")},
    ),
    (
        "two policies share the capacity they both allow",
        [pool("us-east", "us", price=0.5, nodes=2), pool("ca-east", "ca", price=3.0, nodes=2)],
        [demand("both", 2, ("ca", "us")), demand("us-only", 2, ("us",))],
        {"both": {"ca-east": 2}, "us-only": {"us-east": 2}},
        {},
    ),
    (
        "a bound and an unbound deployment share capacity",
        [pool("ca-east", "ca", price=0.5, nodes=2), pool("us-east", "us", price=3.0, nodes=2)],
        [demand("free", 2, None), demand("ca-only", 2, ("ca",))],
        {"free": {"us-east": 2}, "ca-only": {"ca-east": 2}},
        {},
    ),
]


@pytest.mark.parametrize("placer", sorted(PLACERS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_residency_in_placement(placer, case):
    _, pools, demands, placed, short = case
    result = PLACERS[placer].place(demands, pools)
    for name, clusters in placed.items():
        assert where(result, pools, name) == Counter(clusters), name
    for d in demands:
        u = unplaced(result, d.deployment)
        if d.deployment in short:
            missing, reason = short[d.deployment]
            assert u is not None and u.missing == missing, u
            assert reason in u.reason, u.reason
        else:
            assert u is None, u
    assert violations(demands, pools, result.assignments) == []


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_running_replicas_outside_a_new_policy_move_home(placer):
    """Residency set on a running deployment: its replicas abroad go, new ones start at home."""
    pools = [CA1, US]
    running = [
        Assignment(replica_id=f"a-{i}", deployment="a", version=1, cluster="us-east", pool="p", node=i)
        for i in range(2)
    ]
    result = PLACERS[placer].place([demand("a", 2, ("ca",))], pools, running)
    assert sorted(result.removed) == ["a-0", "a-1"]
    assert where(result, pools, "a") == Counter({"ca-east": 2})


def test_pipeline_keeps_residency_when_it_falls_back():
    """The pipeline verifies every plan against the policy (the FFD fallback keeps it too)."""
    pools = [CA1, US]
    outcome = run(PlacementInputs(demands=(demand("a", 2, ("ca",)),), pools=tuple(pools)), "milp")
    assert outcome.problems == ()
    assert where(outcome.result, pools, "a") == Counter({"ca-east": 2})


def test_standby_obeys_residency():
    """A standby region outside the deployment's jurisdictions gets no standby replica, and says why."""
    pools = [CA1, US]
    standby = StandbyDemand(deployment="a", version=1, regions=("ca-east", "us-east"), residency=("ca",))
    inputs = PlacementInputs(demands=(demand("a", 1, ("ca",)),), pools=tuple(pools), standby=(standby,))
    result = run(inputs, "ffd").result
    assert set(where(result, pools, "a")) == {"ca-east"}
    assert any("residency ca" in u.reason and "us-east" in u.reason for u in result.unplaced)


def test_snapshot_carries_jurisdiction_and_residency_into_placement():
    """The reconcile loop's inputs: each pool has its cluster's jurisdiction, each demand its
    deployment's residency."""

    def cluster(cid: str, jurisdiction: str) -> ClusterRow:
        return ClusterRow(
            id=cid,
            region=cid,
            jurisdiction=jurisdiction,
            pools=(PoolRow(name="p", gpu_model="cpu", nodes=2),),
        )

    snap = FleetSnapshot(
        deployments=(DeploymentRow(name="a", replicas=2, current_version=1, residency=("ca",)),),
        specs={("a", 1): VersionSpec(deployment="a", version=1, model="m")},
        clusters=(cluster("east", "ca"), cluster("west", "us"), cluster("lab", "")),
    )
    demands, pools, _ = placement_inputs(snap)
    assert demands[0].residency == ("ca",)
    assert {p.cluster: p.jurisdiction for p in pools} == {"east": "ca", "west": "us", "lab": ""}
    result = FirstFitDecreasing().place(demands, pools)
    assert {a.cluster for a in result.assignments} == {"east"}


# ---------------------------------------------------------------- catalogs and `fleetctl plan`

CATALOG = """InstanceType,AcceleratorName,AcceleratorCount,Region,Price,SpotPrice,Jurisdiction
n1,L4,1,northamerica-northeast1,1.0,,CA
n1,L4,1,us-east4,0.8,,us
n1,L4,1,europe-west4,0.7,,
"""


def test_catalog_jurisdiction_column():
    offers, _ = parse_catalog(CATALOG, "gcp", tiers=(Tier.on_demand,))
    assert {p.region: p.jurisdiction for p in offers_to_pools(offers)} == {
        "northamerica-northeast1": "ca",
        "us-east4": "us",
        "europe-west4": "",
    }


@pytest.mark.parametrize(
    "row, error",
    [
        ("n2,L4,1,us-east4,0.8,,ca", "two jurisdictions"),
        ("n2,L4,1,us-east4,0.8,,U S", "not a label"),
    ],
)
def test_catalog_jurisdiction_errors(row, error):
    with pytest.raises(CatalogError, match=error):
        parse_catalog(CATALOG + row + "\n", "gcp")


def test_plan_prices_residency_against_no_policy():
    """The shipped example: two jurisdictions; the `ca` chat deployment pays for Canadian
    H100s, every bound replica stays in its jurisdiction, and the report compares."""
    spec = DemandsFile.model_validate(json.loads((EXAMPLES / "demands-residency.json").read_text()))
    offers, _ = parse_catalog((EXAMPLES / "gcp_residency.csv").read_text(), "gcp", capacity=3)
    pools = offers_to_pools(offers)
    demands = [d.demand() for d in spec.deployments]
    report = plan(demands, pools, time_limit_s=5)
    assert report.violations == [] and report.unplaced == []
    jurisdiction = {p.region: p.jurisdiction for p in pools}
    for d in demands:
        allowed = residency.allowed(d.residency)
        for region in report.replicas_by_region[d.deployment]:
            assert residency.permits(allowed, jurisdiction[region]), (d.deployment, region)
    cost = report.residency_cost
    assert cost is not None
    rows = {r.deployment: r for r in cost.deployments}
    assert rows["chat-ca"].policy.cost_per_hour > rows["chat-ca"].none.cost_per_hour
    assert rows["embed"].residency is None
    assert cost.extra_cost_per_hour > 0 and cost.policy.gpus == cost.none.gpus
    assert cost.policy.rtt_ms is not None and cost.none.rtt_ms is not None


def test_plan_reports_what_residency_leaves_unplaced():
    pools = [pool("ca-east", "ca", region="northamerica-northeast1", nodes=1), US]
    report = plan([demand("a", 2, ("ca",))], pools, time_limit_s=5)
    assert report.residency_cost is not None
    assert (report.residency_cost.policy.unplaced, report.residency_cost.none.unplaced) == (1, 0)
    assert "residency ca" in report.unplaced[0]["reason"]


@pytest.mark.parametrize("bad", [[], ["C A"], "ca,,us"])
def test_demands_file_rejects_a_bad_policy(bad):
    with pytest.raises(ValueError, match="residency"):
        DemandsFile.model_validate({"deployments": [{"name": "a", "replicas": 1, "residency": bad}]})


# ---------------------------------------------------------------- the property

JURISDICTIONS = ["ca", "us", "eu", ""]
POLICIES = [None, ("ca",), ("us",), ("ca", "us"), ("eu", "ca"), ()]


@st.composite
def fleets(draw):
    pools = [
        PoolCapacity(
            cluster=f"c{i}",
            name="p",
            region=draw(st.sampled_from(["r1", "r2", "r3"])),
            jurisdiction=draw(st.sampled_from(JURISDICTIONS)),
            gpu_model="h100",
            gpus_per_node=draw(st.sampled_from([1, 2, 4])),
            nodes=draw(st.integers(0, 3)),
            tier=draw(st.sampled_from(list(Tier))),
            hourly_price=draw(st.floats(0, 20, allow_nan=False)),
            cluster_status=draw(st.sampled_from([ClusterStatus.healthy] * 3 + [ClusterStatus.draining])),
        )
        for i in range(draw(st.integers(1, 5)))
    ]
    demands = [
        ReplicaDemand(
            deployment=f"d{i}",
            version=1,
            count=draw(st.integers(0, 5)),
            gpu_count=draw(st.sampled_from([1, 2])),
            regions=tuple(draw(st.lists(st.sampled_from(["r1", "r2", "r*"]), max_size=2))),
            min_regions=draw(st.integers(1, 2)),
            residency=draw(st.sampled_from(POLICIES)),
            priority=draw(st.sampled_from(["batch", "standard", "critical"])),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    current = [
        Assignment(
            replica_id=f"cur-{i}",
            deployment=draw(st.sampled_from(demands)).deployment,
            version=1,
            cluster=(p := draw(st.sampled_from(pools))).cluster,
            pool=p.name,
            gpus=draw(st.sampled_from([1, 2])),
            node=draw(st.none() | st.integers(0, 2)),
        )
        for i in range(draw(st.integers(0, 4)))
    ]
    return pools, demands, current


def check_residency(pools, demands, result) -> None:
    by_pool = {p.key: p for p in pools}
    by_demand = {d.key: d for d in demands}
    for a in result.assignments:
        d, p = by_demand[(a.deployment, a.version)], by_pool[a.pool_key]
        assert residency.permits(residency.allowed(d.residency), p.jurisdiction), (d, p)
    placed = Counter((a.deployment, a.version) for a in result.assignments)
    missing = {(u.deployment, u.version): u for u in result.unplaced}
    for d in demands:
        assert placed[d.key] + (missing[d.key].missing if d.key in missing else 0) == d.count
        others = [p for p in pools if d.model_ok(p) and d.memory_ok(p) and d.region_ok(p) and d.shape_ok(p)]
        if d.count and others and not any(d.residency_ok(p) for p in others):
            assert placed[d.key] == 0 and "residency" in missing[d.key].reason


@seed(36)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets())
def test_ffd_never_places_a_bound_replica_outside_its_jurisdictions(fleet):
    pools, demands, current = fleet
    check_residency(pools, demands, FirstFitDecreasing().place(demands, pools, current))


@seed(36)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets())
def test_milp_never_places_a_bound_replica_outside_its_jurisdictions(fleet):
    pools, demands, current = fleet
    outcome = run(PlacementInputs(demands=tuple(demands), pools=tuple(pools), current=tuple(current)), "milp")
    check_residency(pools, demands, outcome.result)


def test_autoscaler_prices_the_gpu_mix_over_the_pools_residency_allows():
    """The autoscale loop's variants come from the pools a bound deployment may use."""
    from types import SimpleNamespace

    from control_plane.autoscale.observe import within_residency

    def row(name: str, jurisdiction: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, cluster=SimpleNamespace(jurisdiction=jurisdiction))

    pools = [row("ca", "ca"), row("us", "us"), row("bare", "")]
    assert [p.name for p in within_residency(pools, None)] == ["ca", "us", "bare"]
    assert [p.name for p in within_residency(pools, ["ca"])] == ["ca"]
    assert within_residency(pools, []) == []


@pytest.mark.parametrize("placer", ["milp", "ffd"])
def test_reconcile_places_a_bound_deployment_at_home_and_reports_the_rest(sessions, placer):
    """The live path on a real database: clusters' jurisdictions and a deployment's
    residency reach the placer; replicas land only at home, the excess is a
    `placement_short` event naming residency, and setting the policy later moves the
    replicas placed abroad home."""
    from sqlalchemy import select

    from control_plane.db import models as m
    from control_plane.loops.reconcile import reconcile_once
    from control_plane.placement import get_placer

    with sessions() as s:
        for cid, jurisdiction, price in (("east", "ca", 3.0), ("west", "us", 1.0), ("lab", "", 0.5)):
            c = m.Cluster(id=cid, region=cid, status="healthy", load={}, jurisdiction=jurisdiction)
            c.last_heartbeat_at = m.utcnow()
            c.pools = [
                m.CapacityPool(name="sim", gpu_model="sim", gpus_per_node=1, nodes=2, hourly_price=price)
            ]
            s.add(c)
        d = m.Deployment(name="chat", replicas=3, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="tiny", min_replicas=3, max_replicas=3)]
        s.add(d)
        s.commit()

    def placed() -> Counter:
        with sessions() as s:
            return Counter(a.cluster_id for a in s.scalars(select(m.ReplicaAssignment)))

    p, memory = get_placer(placer), ({}, {})
    reconcile_once(sessions, p, *memory)
    assert sum(placed().values()) == 3 and set(placed()) != {"east"}  # no policy: cheapest first
    with sessions() as s:
        s.scalar(select(m.Deployment)).residency = ["ca"]
        s.commit()
    reconcile_once(sessions, p, *memory)
    assert placed() == Counter({"east": 2})
    with sessions() as s:
        shorts = s.scalars(select(m.Event).where(m.Event.kind == "placement_short")).all()
    assert any("residency ca" in e.message for e in shorts), [e.message for e in shorts]
