"""Table tests of the routing plan: every branch, one row each (facts in, attempts out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import pytest

from agent.gateway.kv_index import KvUpdate, PrefixIndex
from agent.gateway.plan import (
    MAX_ATTEMPTS,
    STAGE_RULES,
    Attempt,
    ClusterFacts,
    CostModel,
    PeerFacts,
    Plan,
    ReplicaFacts,
    RequestFacts,
    Stage,
    plan_failover,
    plan_route,
)
from fleet_base.protocol import VersionWeight

HERE = "east"
PROMPT = tuple(range(100, 164))  # 64 block keys of a 1,024-token prompt (16 a block)


def rep(rid: str, load: int = 0, *, failed: bool = False, version: int = 1) -> ReplicaFacts:
    return ReplicaFacts(rid, f"http://{rid}", version, outstanding_tokens=load, recently_failed=failed)


def index_with(holdings: dict[tuple[str, str], int]) -> PrefixIndex:
    """(cluster, replica) -> how many leading blocks of PROMPT it holds."""
    index = PrefixIndex()
    for (cluster, rid), n in holdings.items():
        index.apply(KvUpdate(cluster, rid, "d", "e1", 0, (("stored", PROMPT[:n]),), snapshot=True))
    return index


REQ = RequestFacts("d", prompt_tokens=1024, cost_tokens=1024 + 64, block_hashes=PROMPT, block_tokens=16)
PEER_W = PeerFacts("west", "http://west", rtt_s=0.05, replica_ids=("w1",))
PEER_S = PeerFacts("south", "http://south", rtt_s=0.02, replica_ids=("s1",))


@dataclass
class Row:
    name: str
    request: RequestFacts
    here: ClusterFacts
    peers: tuple[PeerFacts, ...] = ()
    held: dict[tuple[str, str], int] | None = None
    routing: str = "prefix"
    # expected: (stage, target, reason) of the first attempts, in order
    expect: tuple[tuple[str, str, str], ...] = ()


ROWS = [
    Row(
        "local least-load: no prefix known anywhere",
        REQ,
        ClusterFacts(HERE, (rep("r1", 500), rep("r2", 100))),
        expect=(("local", "r2", "least-load"), ("local", "r1", "retry")),
    ),
    Row(
        "cached replica beats an idle one",
        REQ,
        ClusterFacts(HERE, (rep("r1", 0), rep("r2", 300))),
        held={(HERE, "r2"): 60},
        expect=(("local", "r2", "prefix"), ("local", "r1", "retry")),
    ),
    Row(
        "the same facts under least-load ignore the cache",
        REQ,
        ClusterFacts(HERE, (rep("r1", 0), rep("r2", 300))),
        held={(HERE, "r2"): 60},
        routing="least-load",
        expect=(("local", "r1", "least-load"),),
    ),
    Row(
        "an overloaded cached replica loses to an idle one",
        REQ,
        ClusterFacts(HERE, (rep("r1", 0), rep("r2", 50_000))),
        held={(HERE, "r2"): 60},
        expect=(("local", "r1", "load-over-prefix"), ("local", "r2", "retry")),
    ),
    Row(
        "a peer's claimed prefix never draws a request a local replica can serve",
        REQ,
        ClusterFacts(HERE, (rep("r1", 2000),)),
        peers=(PEER_S, PEER_W),
        held={("west", "w1"): 64},
        expect=(("local", "r1", "least-load"), ("local", "r1", "retry")),
    ),
    Row(
        "leaving anyway (no replica here): the peer holding the prefix before the nearest",
        REQ,
        ClusterFacts(HERE, ()),
        peers=(PEER_S, PEER_W),
        held={("west", "w1"): 64},
        expect=(("peer", "west", "peer-prefix"), ("peer", "south", "retry")),
    ),
    Row(
        "a peer's prefix does not beat a local one",
        REQ,
        ClusterFacts(HERE, (rep("r1", 0),)),
        peers=(PEER_W,),
        held={("west", "w1"): 64, (HERE, "r1"): 10},
        expect=(("local", "r1", "prefix"),),
    ),
    Row(
        "a far peer's prefix is not worth its RTT",
        REQ,
        ClusterFacts(HERE, (rep("r1", 0),)),
        peers=(PeerFacts("moon", "http://moon", rtt_s=2.0, replica_ids=("m1",)),),
        held={("moon", "m1"): 64},
        expect=(("local", "r1", "least-load"), ("local", "r1", "retry")),
    ),
    Row(
        "standby here: a live primary peer goes first, then local, then failover",
        REQ,
        ClusterFacts(HERE, (rep("r1"),), standby_here=True),
        peers=(PEER_W,),
        expect=(("primary", "west", "standby-primary"),),
    ),
    Row(
        "no replica here: the nearest live peer",
        REQ,
        ClusterFacts(HERE, ()),
        peers=(PEER_S, PEER_W),
        expect=(("peer", "south", "no-local-replica"), ("peer", "west", "retry")),
    ),
    Row(
        "no replica and no peer: wait for one here",
        REQ,
        ClusterFacts(HERE, ()),
        expect=(("local", "", "wait-for-replica"),),
    ),
    Row(
        "every local replica just failed: a peer",
        REQ,
        ClusterFacts(HERE, (rep("r1", failed=True),)),
        peers=(PEER_W,),
        expect=(("peer", "west", "local-unusable"),),
    ),
    Row(
        "our agent went silent: a peer",
        REQ,
        ClusterFacts(HERE, (rep("r1"),), agent_silent=True),
        peers=(PEER_W,),
        expect=(("peer", "west", "local-unusable"),),
    ),
    Row(
        "the queue here is past the spill threshold: a peer",
        REQ,
        ClusterFacts(HERE, (rep("r1"),), waiting=4, spill_per_replica=2.0),
        peers=(PEER_W,),
        expect=(("peer", "west", "spill"),),
    ),
    Row(
        "a forwarded request is served here, never sent on",
        RequestFacts("d", 1024, 1088, forwarded=True, block_hashes=PROMPT),
        ClusterFacts(HERE, (rep("r1", 10), rep("r2", 0))),
        peers=(PEER_W,),
        held={("west", "w1"): 64},
        expect=(("local", "r2", "least-load"), ("local", "r1", "retry"), ("local", "r2", "retry")),
    ),
    Row(
        "a forwarded request with no replica here waits for one",
        RequestFacts("d", 1024, 1088, forwarded=True),
        ClusterFacts(HERE, ()),
        peers=(PEER_W,),
        expect=(("local", "", "wait-for-replica"),),
    ),
    Row(
        "a recently failed replica goes last, even when cached",
        REQ,
        ClusterFacts(HERE, (rep("r1", failed=True), rep("r2", 100))),
        held={(HERE, "r1"): 64},
        expect=(("local", "r2", "least-load"), ("local", "r1", "retry")),
    ),
]


def _first(plan: Plan, n: int) -> tuple[tuple[str, str, str], ...]:
    return tuple((a.stage, a.name, a.reason) for a in plan.attempts[:n])


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_plan_table(row: Row) -> None:
    index = index_with(row.held or {})
    plan = plan_route(row.request, row.here, row.peers, index, CostModel(routing=row.routing))
    assert _first(plan, len(row.expect)) == row.expect


def test_a_peer_claiming_every_prefix_gets_nothing_local_replicas_can_serve() -> None:
    """A compromised cluster publishes KV events claiming every block of every prompt and
    no RTT. Its claims cannot be checked here, so they may only choose among peers a
    request goes to anyway: with a local replica that can serve (idle or busy, any prompt
    length), the liar is never tried before it; it appears only among the failover peers."""
    liar = PeerFacts("liar", "http://liar", rtt_s=0.0, replica_ids=("x1",))
    index = index_with({("liar", "x1"): 64})
    for load in (0, 2000, 50_000):
        plan = plan_route(REQ, ClusterFacts(HERE, (rep("r1", load),)), (PEER_S, liar), index)
        assert plan.stages == ["local", "failover"], (load, plan.stages)
        assert {a.name for a in plan.stage("local")} == {"r1"}
    spill = ClusterFacts(HERE, (rep("r1"),), waiting=4, spill_per_replica=2.0)
    assert plan_route(REQ, spill, (PEER_S, liar), index).attempts[0].name == "liar"  # leaving anyway


def test_standby_plan_falls_back_to_local_then_failover_and_failover_follows_local() -> None:
    plan = plan_route(REQ, ClusterFacts(HERE, (rep("r1"),), standby_here=True), (PEER_W,))
    assert plan.stages == ["primary", "local", "failover"]
    plan = plan_route(REQ, ClusterFacts(HERE, (rep("r1"),)), (PEER_S, PEER_W))
    assert plan.stages == ["local", "failover"]
    assert [a.name for a in plan.stage("failover")] == ["south", "west", "south"]
    assert all(len(plan.stage(s)) <= MAX_ATTEMPTS for s in plan.stages)


def test_canary_version_comes_first_and_retries_stay_in_it() -> None:
    here = ClusterFacts(
        HERE,
        (rep("old-1", 0, version=1), rep("old-2", 0, version=1), rep("new-1", 0, version=2)),
        versions=(VersionWeight(version=1, weight=3), VersionWeight(version=2, weight=1)),
    )
    low = plan_route(RequestFacts("d", 10, 20, draw=0.1), here, ()).stage("local")
    high = plan_route(RequestFacts("d", 10, 20, draw=0.9), here, ()).stage("local")
    assert [a.version for a in low[:2]] == [1, 1] and low[0].name != low[1].name
    assert high[0].name == "new-1"


def test_cached_tokens_never_cover_the_last_prompt_token() -> None:
    req = RequestFacts("d", prompt_tokens=64, cost_tokens=80, block_hashes=PROMPT[:4], block_tokens=16)
    plan = plan_route(req, ClusterFacts(HERE, (rep("r1"),)), (), index_with({(HERE, "r1"): 4}))
    assert plan.attempts[0].cached_tokens == 63


def test_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing"):
        CostModel(routing="random")


def test_failover_is_planned_fresh_and_never_for_a_forwarded_request() -> None:
    assert [a.name for a in plan_failover(REQ, (PEER_S,))] == ["south"] * MAX_ATTEMPTS
    assert plan_failover(RequestFacts("d", 10, 20, forwarded=True), (PEER_S,)) == []
    assert plan_failover(REQ, ()) == []


def test_every_stage_says_what_its_failure_means() -> None:
    assert set(STAGE_RULES) == set(get_args(Stage))
    assert STAGE_RULES["local"].on_failure == "failover" and STAGE_RULES["failover"].after_failure
    assert {s for s, r in STAGE_RULES.items() if r.on_failure == "next-stage"} == {"primary"}
    assert all(rule.midstream == "migrate" for rule in STAGE_RULES.values())
    assert Attempt("peer", "spill", "west", is_peer=True).charge == "elsewhere"
    assert Attempt("local", "prefix", "r1").charge == "here"
