"""Co-placement of pipelines: in every cluster every step of a pipeline has a replica or
none does, in both placers; what cannot hold is unplaced with the pipeline named."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import FirstFitDecreasing, MilpPlacer, PoolCapacity, ReplicaDemand
from control_plane.placement.base import PlacementResult, Unplaced
from control_plane.placement.colocation import groups, splits
from control_plane.placement.evaluate import plan_problems, violations
from control_plane.placement.ffd import spot_safe_ffd
from control_plane.placement.pipeline import PlacementInputs, run
from control_plane.placement.standby import StandbyDemand
from fleet_base.domain import ClusterStatus, Tier
from fleet_base.pipelines import PipelineSpec, PipelineStep

PLACERS = {"ffd": FirstFitDecreasing, "milp": lambda: MilpPlacer(time_limit_s=2.0)}


def pool(cluster: str, model: str, nodes: int = 2, per_node: int = 8, price: float = 10.0) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster,
        name=model,
        region=f"region-{cluster}",
        gpu_model=model,
        gpu_memory_gb=80,
        gpus_per_node=per_node,
        nodes=nodes,
        tier=Tier.on_demand,
        hourly_price=price,
    )


def demand(name: str, count: int, model: str, gpus: int = 1) -> ReplicaDemand:
    return ReplicaDemand(deployment=name, version=1, count=count, gpu_models=(model,), gpu_count=gpus)


def pipeline(name: str, **steps: str) -> PipelineSpec:
    return PipelineSpec(name=name, steps=tuple(PipelineStep(name=s, deployment=d) for s, d in steps.items()))


RAG = pipeline("rag", embed="emb", answer="chat")


def clusters_of(result, deployment: str) -> set[str]:
    return {a.cluster for a in result.assignments if a.deployment == deployment}


def counts(result) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for a in result.assignments:
        out[a.deployment] += 1
    return dict(out)


CASES = [
    # (case, pools, demands, pipelines, where each deployment may be, replicas placed)
    (
        "the cheap cluster lacks the answer step's GPU: both steps go where both fit",
        [pool("a", "l4", price=1.0), pool("b", "l4", price=5.0), pool("b", "h100", price=40.0)],
        [demand("emb", 3, "l4"), demand("chat", 1, "h100")],
        [RAG],
        {"emb": {"b"}, "chat": {"b"}},
        {"emb": 3, "chat": 1},
    ),
    (
        "two clusters host both steps: every cluster with a step has both",
        [pool(c, m, nodes=1) for c in ("a", "b") for m in ("l4", "h100")],
        [demand("emb", 2, "l4", gpus=8), demand("chat", 2, "h100", gpus=8)],
        [RAG],
        {"emb": {"a", "b"}, "chat": {"a", "b"}},
        {"emb": 2, "chat": 2},
    ),
    (
        "a deployment shared by two pipelines: only where both pipelines fit whole",
        [
            pool("a", "l4", price=1.0),
            pool("a", "h100"),
            pool("b", "l4", price=5.0),
            pool("b", "h100"),
            pool("b", "t4"),
        ],
        [
            demand("emb", 2, "l4"),
            demand("chat", 1, "h100"),
            demand("rerank", 1, "t4"),
            demand("solo", 1, "l4"),
        ],
        [RAG, pipeline("search", embed="emb", rerank="rerank")],
        {"emb": {"b"}, "chat": {"b"}, "rerank": {"b"}, "solo": {"a", "b"}},
        {"emb": 2, "chat": 1, "rerank": 1, "solo": 1},
    ),
    (
        "capacity: the cluster with room for the answer lacks it for the embedder",
        [
            pool("a", "l4", nodes=0),
            pool("a", "h100", nodes=1, price=1.0),
            pool("b", "l4"),
            pool("b", "h100", price=50.0),
        ],
        [demand("emb", 1, "l4"), demand("chat", 1, "h100", gpus=8)],
        [RAG],
        {"emb": {"b"}, "chat": {"b"}},
        {"emb": 1, "chat": 1},
    ),
    (
        "capacity: one embedder cannot follow two answer clusters, so one answer is short",
        [pool("a", "l4"), pool("a", "h100", nodes=1), pool("b", "l4"), pool("b", "h100", nodes=1)],
        [demand("emb", 1, "l4"), demand("chat", 2, "h100", gpus=8)],
        [RAG],
        {"emb": {"a", "b"}, "chat": {"a", "b"}},
        {"emb": 1, "chat": 1},
    ),
    (
        "first fit puts both embedders in a and the answers in a and b: one embedder moves to b",
        [
            pool("a", "l4", nodes=1, price=1.0),
            pool("a", "h100", nodes=1, price=1.0),
            pool("b", "l4", nodes=1, price=5.0),
            pool("b", "h100", nodes=1, price=5.0),
        ],
        [demand("emb", 2, "l4"), demand("chat", 2, "h100", gpus=8)],
        [RAG],
        {"emb": {"a", "b"}, "chat": {"a", "b"}},
        {"emb": 2, "chat": 2},
    ),
]


@pytest.mark.parametrize("placer", sorted(PLACERS))
@pytest.mark.parametrize(
    ("case", "pools", "demands", "pipes", "allowed", "placed"), CASES, ids=[c[0] for c in CASES]
)
def test_co_placement(placer, case, pools, demands, pipes, allowed, placed) -> None:
    result = PLACERS[placer]().place(demands, pools, pipelines=pipes)
    assert splits(pipes, demands, result.assignments) == [], case
    assert violations(demands, pools, result.assignments) == []
    for dep, where in allowed.items():
        assert clusters_of(result, dep) <= where, (case, dep)
    assert counts(result) == placed, case
    for u in result.unplaced:
        assert "pipeline rag" in u.reason and u.missing > 0


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_the_constraint_binds_unconstrained_placement_splits(placer) -> None:
    """Without the pipeline the cheap cluster takes the embedder: the constraint is what moves it."""
    pools = CASES[0][1]
    demands = CASES[0][2]
    free = PLACERS[placer]().place(demands, pools)
    assert splits([RAG], demands, free.assignments) != []


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_no_cluster_hosts_every_step_reason_names_pipeline_step_and_gpu(placer) -> None:
    pools = [pool("a", "l4"), pool("b", "a100")]
    demands = [demand("emb", 1, "l4"), demand("chat", 1, "h100")]
    result = PLACERS[placer]().place(demands, pools, pipelines=[RAG])
    assert result.assignments == ()
    reasons = {u.deployment: u.reason for u in result.unplaced}
    assert set(reasons) == {"emb", "chat"}
    for reason in reasons.values():
        assert "pipeline rag: no cluster can host every step" in reason
        assert "step answer (deployment chat)" in reason and "h100" in reason


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_running_replicas_outside_the_pipelines_clusters_are_moved(placer) -> None:
    pools = CASES[0][1]
    demands = CASES[0][2]
    running = FirstFitDecreasing().place(demands, pools).assignments
    assert any(a.cluster == "a" for a in running)
    result = PLACERS[placer]().place(demands, pools, running, pipelines=[RAG])
    assert splits([RAG], demands, result.assignments) == []
    assert {a.cluster for a in result.assignments} == {"b"}


def test_the_pipeline_verifies_splits_and_falls_back() -> None:
    """A placer that ignores pipelines is caught by verify and replaced by first-fit-decreasing."""

    class Splitter(FirstFitDecreasing):
        def place(self, demands, pools, current=(), pipelines=()):
            return super().place(demands, pools, current)

    pools, demands = CASES[0][1], CASES[0][2]
    inputs = PlacementInputs(demands=tuple(demands), pools=tuple(pools), pipelines=(RAG,))
    out = run(inputs, MilpPlacer(time_limit_s=2.0))
    assert splits([RAG], demands, out.result.assignments) == [] and out.info.method.startswith("milp")
    out = run(inputs, Splitter())
    assert out.problems and "pipeline rag split" in out.problems[0]
    out = run(inputs, _SplittingMilp(time_limit_s=2.0))
    assert out.info.method == "greedy-error" and splits([RAG], demands, out.result.assignments) == []


class _SplittingMilp(MilpPlacer):
    def solve(self, demands, pools, current=(), lp_bound=False, previous=None, pipelines=()):
        return super().solve(demands, pools, current, lp_bound, previous)


# ---------------------------------------------------------------- properties

MODELS = ["l4", "h100", "t4"]
DEPLOYMENTS = ["d0", "d1", "d2", "d3"]


@st.composite
def fleet_st(draw):
    pools = []
    for i in range(draw(st.integers(1, 4))):
        for model in draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True)):
            pools.append(
                PoolCapacity(
                    cluster=f"c{i}",
                    name=model,
                    region=f"r{i % 2}",
                    gpu_model=model,
                    gpus_per_node=draw(st.sampled_from([1, 2, 8])),
                    nodes=draw(st.integers(0, 3)),
                    tier=draw(st.sampled_from(list(Tier))),
                    hourly_price=draw(st.floats(0, 40, allow_nan=False)),
                    cluster_status=draw(
                        st.sampled_from([ClusterStatus.healthy] * 3 + [ClusterStatus.draining])
                    ),
                )
            )
    demands = [
        ReplicaDemand(
            deployment=name,
            version=1,
            count=draw(st.integers(0, 5)),
            gpu_models=(draw(st.sampled_from(MODELS)),),
            gpu_count=draw(st.sampled_from([1, 2, 8])),
            min_regions=draw(st.integers(1, 2)),
            max_spot_fraction=draw(st.sampled_from([1.0, 0.5])),
        )
        for name in DEPLOYMENTS
    ]
    pipes = []
    for i in range(draw(st.integers(1, 2))):
        deps = draw(st.lists(st.sampled_from(DEPLOYMENTS), min_size=2, max_size=3, unique=True))
        pipes.append(
            PipelineSpec(
                name=f"p{i}",
                steps=tuple(PipelineStep(name=f"s{j}", deployment=d) for j, d in enumerate(deps)),
            )
        )
    running = draw(st.booleans())
    return pools, demands, pipes, running


PROFILE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("placer", ["ffd", "milp", "spot-safe-ffd"])
@PROFILE
@given(fleet=fleet_st())
def test_no_placement_ever_splits_a_pipeline(placer, fleet) -> None:
    pools, demands, pipes, with_running = fleet
    current = FirstFitDecreasing().place(demands, pools).assignments if with_running else ()
    if placer == "spot-safe-ffd":  # the fallback: drops spot replicas past max_spot_fraction
        result = spot_safe_ffd(demands, pools, current, pipelines=pipes)
    else:
        inputs = PlacementInputs(
            demands=tuple(demands), pools=tuple(pools), current=tuple(current), pipelines=tuple(pipes)
        )
        result = run(inputs, PLACERS[placer]()).result
    assert splits(pipes, demands, result.assignments) == []
    broken = violations(demands, pools, result.assignments)
    if placer == "ffd":  # plain first-fit-decreasing does not know max_spot_fraction
        broken = [b for b in broken if "on spot" not in b]
    assert broken == []
    stepped = {dep for g in groups(pipes, demands, pools) for dep in g.deployments}
    for u in result.unplaced:  # a step short of replicas says which pipeline holds it back
        assert u.deployment not in stepped or u.missing == 0 or "pipeline " in u.reason, u.reason
    short = {(u.deployment, u.version): u.missing for u in result.unplaced}
    for d in demands:
        placed = sum(1 for a in result.assignments if a.deployment == d.deployment)
        assert placed + short.get(d.key, 0) == d.count, d.deployment


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_reconcile_places_a_stored_pipeline_together(sessions, placer) -> None:
    """The live path: the pipelines in the database reach the placer; the embedder leaves
    the cheap cluster without the answer step's GPU, and a pipeline no cluster can host
    whole is a `placement_short` event naming it."""
    from collections import Counter

    from sqlalchemy import select

    from control_plane.db import models as m
    from control_plane.loops.reconcile import reconcile_once
    from control_plane.pipelines import row_of
    from control_plane.placement import get_placer

    with sessions() as s:
        for cid, models, price in (("cheap", ("l4",), 0.5), ("full", ("l4", "h100"), 3.0)):
            c = m.Cluster(id=cid, region=cid, status="healthy", load={})
            c.last_heartbeat_at = m.utcnow()
            c.pools = [
                m.CapacityPool(name=g, gpu_model=g, gpus_per_node=1, nodes=2, hourly_price=price)
                for g in models
            ]
            s.add(c)
        for name, gpu in (("emb", "l4"), ("chat", "h100"), ("vision", "a100")):
            d = m.Deployment(name=name, replicas=1, current_version=1)
            d.versions = [
                m.DeploymentVersion(version=1, model="tiny", gpu_models=[gpu], min_replicas=1, max_replicas=1)
            ]
            s.add(d)
        s.commit()

    def placed() -> Counter:
        with sessions() as s:
            names = {d.id: d.name for d in s.scalars(select(m.Deployment))}
            return Counter(
                (names[a.deployment_id], a.cluster_id) for a in s.scalars(select(m.ReplicaAssignment))
            )

    p, memory = get_placer(placer), ({}, {})
    reconcile_once(sessions, p, *memory)
    assert placed()[("emb", "cheap")] == 1  # no pipeline: the cheapest pool
    with sessions() as s:
        s.add(row_of(RAG))
        s.add(row_of(pipeline("see", embed="emb", look="vision")))  # no cluster has a100
        s.commit()
    reconcile_once(sessions, p, *memory)
    assert placed() == Counter()  # emb is a step of `see` too: no cluster hosts it whole
    with sessions() as s:
        shorts = [e.message for e in s.scalars(select(m.Event).where(m.Event.kind == "placement_short"))]
    assert any("pipeline rag, see: no cluster can host every step" in e for e in shorts), shorts
    with sessions() as s:
        s.delete(s.scalar(select(m.Pipeline).where(m.Pipeline.name == "see")))
        s.commit()
    reconcile_once(sessions, p, *memory)
    assert placed() == Counter({("emb", "full"): 1, ("chat", "full"): 1})


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_running_steps_leave_a_cluster_the_other_step_has_no_room_in(placer) -> None:
    """The embedders run in `a`, whose H100 pool is full; `b` has room for one of them: one
    moves beside the answer step and one is unplaced naming the pipeline (the MILP itself,
    not its greedy fallback; the pipeline's verify accepts the drop)."""
    pools = [pool("a", "l4", price=1.0), pool("a", "h100", nodes=0), pool("b", "l4", nodes=1, per_node=1)]
    pools.append(pool("b", "h100"))
    demands = [demand("emb", 2, "l4"), demand("chat", 1, "h100")]
    running = FirstFitDecreasing().place(demands, pools).assignments
    assert {a.cluster for a in running if a.deployment == "emb"} == {"a"}
    out = run(
        PlacementInputs(demands=tuple(demands), pools=tuple(pools), current=running, pipelines=(RAG,)),
        PLACERS[placer](),
    )
    assert out.problems == () and splits([RAG], demands, out.result.assignments) == []
    assert {a.cluster for a in out.result.assignments} == {"b"} and counts(out.result) == {
        "emb": 1,
        "chat": 1,
    }
    (short,) = out.result.unplaced
    assert short.deployment == "emb" and short.missing == 1 and "pipeline rag" in short.reason
    if placer == "milp":
        assert out.info is not None and out.info.method.startswith("milp"), out.info


def test_verify_catches_a_wrong_drop_of_a_steps_running_replica() -> None:
    """Only drops co-placement forces are exempt: dropping a running answer replica in a
    cluster that keeps every step, leaving it short, is a wrong drop; the pipeline falls
    back to first-fit-decreasing, which keeps it."""
    pools = [pool(c, m) for c in ("a", "b") for m in ("l4", "h100")]
    demands = [demand("emb", 2, "l4"), demand("chat", 2, "h100")]
    running = FirstFitDecreasing().place(demands, pools).assignments
    assert len(running) == 4 and splits([RAG], demands, running) == []
    chat = [a for a in running if a.deployment == "chat"]
    wrong = PlacementResult(
        kept=tuple(a for a in running if a is not chat[0]),
        removed=(chat[0].replica_id,),
        unplaced=(Unplaced(deployment="chat", version=1, missing=1, reason="dropped"),),
    )
    problems = plan_problems(demands, pools, running, wrong, pipelines=[RAG])
    assert problems == ["chat v1: 1 running replica(s) dropped while 1 short"]

    class Dropper(MilpPlacer):
        def solve(self, demands, pools, current=(), lp_bound=False, previous=None, pipelines=()):
            _, info = super().solve(demands, pools, current, lp_bound, previous, pipelines)
            return wrong, info

    inputs = PlacementInputs(demands=tuple(demands), pools=tuple(pools), current=running, pipelines=(RAG,))
    out = run(inputs, Dropper(time_limit_s=2.0))
    assert out.info.method == "greedy-error" and "dropped" in out.info.note
    assert counts(out.result) == {"emb": 2, "chat": 2} and out.result.removed == ()


def _standby(dep: str, model: str, region: str, gpus: int = 1) -> StandbyDemand:
    return StandbyDemand(deployment=dep, version=1, gpu_models=(model,), gpu_count=gpus, regions=(region,))


@pytest.mark.parametrize("placer", sorted(PLACERS))
def test_a_steps_standby_never_splits_the_pipeline(placer) -> None:
    """The answer step alone has a warm standby in region-b, where the embedder is not:
    it is unplaced naming the pipeline (else failing over there would split it); with a
    standby of every step there, both land together. A kept standby left alone goes."""
    pools = [pool("a", "l4", price=1.0), pool("a", "h100", price=1.0), pool("b", "l4"), pool("b", "h100")]
    demands = [demand("emb", 1, "l4"), demand("chat", 1, "h100")]

    def plan(standby, current=()):
        inputs = PlacementInputs(
            demands=tuple(demands),
            pools=tuple(pools),
            current=tuple(current),
            standby=tuple(standby),
            pipelines=(RAG,),
        )
        return run(inputs, PLACERS[placer]()).result

    alone = plan([_standby("chat", "h100", "region-b")])
    assert splits([RAG], demands, alone.assignments) == []
    assert {a.cluster for a in alone.assignments} == {"a"}
    (short,) = alone.unplaced
    assert short.deployment == "chat" and "pipeline rag" in short.reason
    both = plan([_standby("chat", "h100", "region-b"), _standby("emb", "l4", "region-b")])
    assert splits([RAG], demands, both.assignments) == [] and both.unplaced == ()
    assert counts(both) == {"emb": 2, "chat": 2}
    assert {a.cluster for a in both.assignments} == {"a", "b"}
    warm_chat = [a for a in both.assignments if a.cluster == "b" and a.deployment == "chat"]
    again = plan([_standby("chat", "h100", "region-b")], [*alone.assignments, *warm_chat])
    assert splits([RAG], demands, again.assignments) == []
    assert warm_chat[0].replica_id in again.removed
