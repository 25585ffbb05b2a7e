"""Residency in the routing plan: one table row per stage (local, forward, spill, failover,
retry, primary/standby, a peer's forward), the refusal rows, and a seeded property that no
plan of any facts holds a target outside the request's allowed set."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from agent.gateway.plan import (
    MAX_ATTEMPTS,
    ClusterFacts,
    PeerFacts,
    Plan,
    ReplicaFacts,
    RequestFacts,
    plan_route,
)
from fleet_base.residency import permits

CA = frozenset({"ca"})
REQ = RequestFacts("d", prompt_tokens=100, cost_tokens=200)


def rep(rid: str, *, failed: bool = False) -> ReplicaFacts:
    return ReplicaFacts(rid, f"http://{rid}", 1, recently_failed=failed)


def here(*replicas: ReplicaFacts, jurisdiction: str = "ca", **kw: object) -> ClusterFacts:
    return ClusterFacts("east", tuple(replicas), jurisdiction=jurisdiction, **kw)  # type: ignore[arg-type]


# nearest first: the US peer is the nearest, so without residency it would win every stage
US = PeerFacts("us-1", "http://us-1", rtt_s=0.01, jurisdiction="us")
CA2 = PeerFacts("ca-2", "http://ca-2", rtt_s=0.05, jurisdiction="ca")
NONE = PeerFacts("bare", "http://bare", rtt_s=0.02)  # a region with no jurisdiction
CA_STANDBY = PeerFacts("ca-sb", "http://ca-sb", standby=True, jurisdiction="ca")


@dataclass
class Row:
    name: str
    here: ClusterFacts
    peers: tuple[PeerFacts, ...]
    allowed: frozenset[str] | None = CA
    forwarded: bool = False
    # (stage, target, reason) of every attempt, in order; () with `refused` for a 503
    expect: tuple[tuple[str, str, str], ...] = ()
    refused: bool = False
    excluded: tuple[str, ...] = ()


def _all(stage: str, names: tuple[str, ...], reason: str) -> tuple[tuple[str, str, str], ...]:
    """A stage's attempts: the first with `reason`, the rest retries, around the ranking."""
    picked = [names[i % len(names)] for i in range(MAX_ATTEMPTS)]
    return tuple((stage, n, reason if i == 0 else "retry") for i, n in enumerate(picked))


ROWS = [
    # local: this cluster is permitted; its replicas first, failover only to permitted peers
    Row(
        "local: served here, failover skips the nearer US peer",
        here(rep("r1")),
        (US, CA2),
        expect=_all("local", ("r1",), "least-load") + _all("failover", ("ca-2",), "failover"),
        excluded=("us-1",),
    ),
    Row(
        "local excluded (deployment bound elsewhere): forwarded to a permitted peer only",
        here(rep("r1"), jurisdiction="us"),
        (US, CA2),
        expect=_all("peer", ("ca-2",), "residency"),
        excluded=("us-1",),
    ),
    Row(
        "local of no jurisdiction is outside every policy",
        here(rep("r1"), jurisdiction=""),
        (CA2,),
        expect=_all("peer", ("ca-2",), "residency"),
    ),
    # forward: nothing here, the nearest permitted peer
    Row(
        "forward: no replica here, the permitted peer though farther",
        here(),
        (US, NONE, CA2),
        expect=_all("peer", ("ca-2",), "no-local-replica"),
        excluded=("us-1", "bare"),
    ),
    Row(
        "forward with two permitted jurisdictions keeps distance order",
        here(),
        (US, NONE, CA2),
        allowed=frozenset({"ca", "us"}),
        expect=_all("peer", ("us-1", "ca-2"), "no-local-replica"),
        excluded=("bare",),
    ),
    # spill: a long queue here spills only to permitted peers, else waits here
    Row(
        "spill: to the permitted peer",
        here(rep("r1"), waiting=10, spill_per_replica=2.0),
        (US, CA2),
        expect=_all("peer", ("ca-2",), "spill"),
        excluded=("us-1",),
    ),
    Row(
        "spill: only a US peer, so the request queues here instead",
        here(rep("r1"), waiting=10, spill_per_replica=2.0),
        (US,),
        expect=_all("local", ("r1",), "least-load"),
        excluded=("us-1",),
    ),
    # failover: the local replicas just failed
    Row(
        "local unusable: fails over to the permitted peer",
        here(rep("r1", failed=True)),
        (US, CA2),
        expect=_all("peer", ("ca-2",), "local-unusable"),
        excluded=("us-1",),
    ),
    Row(
        "local unusable, only US peers: retried here, no failover stage",
        here(rep("r1", failed=True)),
        (US,),
        expect=_all("local", ("r1",), "least-load"),
        excluded=("us-1",),
    ),
    # retry: every retry of a stage goes around the permitted peers only
    Row(
        "retry: three attempts, all in the jurisdiction",
        here(),
        (US, CA2, NONE, PeerFacts("ca-3", "http://ca-3", jurisdiction="ca")),
        expect=_all("peer", ("ca-2", "ca-3"), "no-local-replica"),
        excluded=("us-1", "bare"),
    ),
    # primary/standby
    Row(
        "standby here: a US primary is no primary for this request",
        here(rep("r1"), standby_here=True),
        (US,),
        expect=_all("local", ("r1",), "least-load"),
        excluded=("us-1",),
    ),
    Row(
        "standby here with no replica: the permitted primary, not a refusal",
        here(standby_here=True),
        (US, CA2),
        expect=(
            *_all("primary", ("ca-2",), "standby-primary"),
            ("local", "", "wait-for-replica"),
            *_all("failover", ("ca-2",), "failover"),
        ),
        excluded=("us-1",),
    ),
    Row(
        "a permitted standby peer serves when the live primary is outside",
        here(),
        (US, CA_STANDBY),
        expect=_all("peer", ("ca-sb",), "no-local-replica"),
        excluded=("us-1",),
    ),
    # a peer's forward is served where it lands, or not at all
    Row(
        "forwarded here, permitted",
        here(rep("r1")),
        (),
        forwarded=True,
        expect=_all("local", ("r1",), "least-load"),
    ),
    Row("forwarded here, outside", here(rep("r1"), jurisdiction="us"), (CA2,), forwarded=True, refused=True),
    # refusals: nothing permitted anywhere
    Row(
        "only US replicas anywhere",
        here(rep("r1"), jurisdiction="us"),
        (US,),
        refused=True,
        excluded=("us-1",),
    ),
    Row("no live peer and excluded here", here(rep("r1"), jurisdiction="us"), (), refused=True),
    Row(
        "key and deployment share no jurisdiction",
        here(rep("r1")),
        (CA2,),
        allowed=frozenset(),
        refused=True,
        excluded=("ca-2",),
    ),
    Row("no replica here, none coming, only US peers", here(), (US,), refused=True, excluded=("us-1",)),
    Row(
        "no replica here but one starting: wait for it (a timeout names residency)",
        here(coming=True),
        (US,),
        expect=(("local", "", "wait-for-replica"),),
        excluded=("us-1",),
    ),
    # no policy: residency changes nothing
    Row(
        "no policy: the nearest peer, whatever its jurisdiction",
        here(),
        (US, NONE, CA2),
        allowed=None,
        expect=_all("peer", ("us-1", "bare", "ca-2"), "no-local-replica"),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_residency_in_every_stage(row: Row) -> None:
    request = replace(REQ, allowed=row.allowed, forwarded=row.forwarded)
    plan = plan_route(request, row.here, row.peers)
    assert [(a.stage, a.name, a.reason) for a in plan.attempts] == list(row.expect)
    assert plan.residency_unavailable is row.refused
    assert plan.excluded == row.excluded
    assert all(permits(row.allowed, a.jurisdiction) for a in plan.attempts if a.name)


def test_no_policy_plans_exactly_as_before() -> None:
    """A request without a policy gets the plan it got before residency existed, though
    every cluster has a jurisdiction."""
    for row in ROWS:
        with_j = plan_route(replace(REQ, forwarded=row.forwarded), row.here, row.peers)
        bare_here = replace(row.here, jurisdiction="")
        bare_peers = [replace(p, jurisdiction="") for p in row.peers]
        without = plan_route(replace(REQ, forwarded=row.forwarded), bare_here, bare_peers)
        assert [(a.stage, a.name, a.reason) for a in with_j.attempts] == [
            (a.stage, a.name, a.reason) for a in without.attempts
        ]
        assert not with_j.residency_unavailable and with_j.excluded == ()


JURISDICTIONS = st.sampled_from(["", "ca", "us", "eu"])
POLICIES = st.none() | st.frozensets(st.sampled_from(["ca", "us", "eu"]), max_size=3)


@st.composite
def facts(draw: st.DrawFn) -> tuple[RequestFacts, ClusterFacts, list[PeerFacts]]:
    n = draw(st.integers(0, 3))
    replicas = tuple(rep(f"r{i}", failed=draw(st.booleans())) for i in range(n))
    cluster = ClusterFacts(
        "east",
        replicas,
        standby_here=draw(st.booleans()),
        agent_silent=draw(st.booleans()),
        waiting=draw(st.integers(0, 10)),
        spill_per_replica=draw(st.none() | st.just(2.0)),
        jurisdiction=draw(JURISDICTIONS),
        coming=draw(st.booleans()),
    )
    peers = [
        PeerFacts(f"p{i}", f"http://p{i}", standby=draw(st.booleans()), jurisdiction=draw(JURISDICTIONS))
        for i in range(draw(st.integers(0, 4)))
    ]
    request = replace(REQ, allowed=draw(POLICIES), forwarded=draw(st.booleans()))
    return request, cluster, peers


@seed(36)
@settings(max_examples=200, deadline=None)
@given(facts())
def test_no_plan_ever_holds_a_target_outside_the_allowed_set(
    case: tuple[RequestFacts, ClusterFacts, list[PeerFacts]],
) -> None:
    request, cluster, peers = case
    plan: Plan = plan_route(request, cluster, peers)
    for a in plan.attempts:
        jurisdiction = a.jurisdiction if a.name else cluster.jurisdiction  # "wait here" too
        assert permits(request.allowed, jurisdiction), (a, request.allowed)
    if plan.residency_unavailable:
        assert plan.attempts == ()
    permitted = [p for p in peers if permits(request.allowed, p.jurisdiction)]
    if request.allowed is None or (permitted and not request.forwarded):
        assert not plan.residency_unavailable  # something permitted is never refused
