"""The pipeline hop's route as a table: pipeline, which steps are healthy here, the peers
where every step is ready, the request's headers -> serve here / forward to peer X / refuse
with a reason. A pipeline request runs whole in one cluster, never split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gateway.pipeline_route import (
    PipelineFacts,
    decide,
    owner_of,
    ready_peers,
    request_id_for,
)
from fleet_base.pipelines import PipelineSpec, PipelineStep

RAG = PipelineSpec(
    name="rag",
    steps=(PipelineStep(name="embed", deployment="emb"), PipelineStep(name="answer", deployment="chat")),
)
BOTH = frozenset({"emb", "chat"})
MINE = request_id_for("east", "ab" * 12)
WESTS = request_id_for("west", "cd" * 12)


def facts(
    step: str = "embed",
    ready_here: frozenset[str] = BOTH,
    ready: tuple[str, ...] = (),
    live: frozenset[str] = frozenset({"west", "north"}),
    request_id: str | None = None,
    forwarded: bool = False,
    placed: bool = False,
    permitted: bool = True,
    standby_here: bool = False,
    standby: frozenset[str] = frozenset(),
) -> PipelineFacts:
    return PipelineFacts(
        RAG,
        step,
        "east",
        ready_here,
        ready,
        live,
        request_id,
        forwarded,
        placed_here=placed,
        permitted_here=permitted,
        standby_here=standby_here,
        standby_peers=standby,
    )


# (case, facts, (action, reason, peer, carried id, mint))
TABLE = [
    ("new, every step ready here", facts(), ("local", "ready-here", "", "", True)),
    ("new, ready here and at a peer: here", facts(ready=("west",)), ("local", "ready-here", "", "", True)),
    (
        "new, a step missing here: whole to the nearest ready peer",
        facts(ready_here=frozenset({"emb"}), ready=("north", "west")),
        ("forward", "not-ready-here", "north", "", False),
    ),
    (
        "new, the step called is ready here but another is not: still forwarded whole",
        facts(step="embed", ready_here=frozenset({"emb"}), ready=("west",)),
        ("forward", "not-ready-here", "west", "", False),
    ),
    (
        "new, ready nowhere",
        facts(ready_here=frozenset({"emb"})),
        ("refuse", "not-ready-anywhere", "", "", False),
    ),
    (
        "new, ready nowhere, every step placed here at zero: served here (queues, wakes them)",
        facts(ready_here=frozenset(), placed=True),
        ("local", "placed-here", "", "", True),
    ),
    (
        "new, placed here at zero but ready at a peer: whole to the peer",
        facts(ready_here=frozenset(), ready=("west",), placed=True),
        ("forward", "not-ready-here", "west", "", False),
    ),
    (
        "later hop owned here, its step at zero here, ready nowhere: stays for the cold start",
        facts("answer", ready_here=frozenset({"emb"}), request_id=MINE, placed=True),
        ("local", "hop-here", "", MINE, False),
    ),
    (
        "later hop owned here, its step at zero here, ready at a peer: refused (restart fails over)",
        facts("answer", ready_here=frozenset({"emb"}), ready=("west",), request_id=MINE, placed=True),
        ("refuse", "step-down", "", MINE, False),
    ),
    (
        "a peer's forward of a hop owned here, its step at zero, ready nowhere: stays",
        facts("answer", ready_here=frozenset({"emb"}), request_id=MINE, forwarded=True, placed=True),
        ("local", "forwarded-in", "", MINE, False),
    ),
    (
        "new, this cluster a standby and a primary peer ready: whole to the primary",
        facts(ready=("west",), standby_here=True),
        ("forward", "not-ready-here", "west", "", False),
    ),
    (
        "new, this cluster a standby, no primary ready: served here",
        facts(standby_here=True),
        ("local", "ready-here", "", "", True),
    ),
    (
        "new, this cluster a standby and only a standby peer ready: served here",
        facts(ready=("west",), standby_here=True, standby=frozenset({"west"})),
        ("local", "ready-here", "", "", True),
    ),
    (
        "new, not ready here: the nearest ready peer that is no standby, past a nearer standby",
        facts(ready_here=frozenset({"emb"}), ready=("north", "west"), standby=frozenset({"north"})),
        ("forward", "not-ready-here", "west", "", False),
    ),
    (
        "new, not ready here, only a standby peer ready: to it",
        facts(ready_here=frozenset({"emb"}), ready=("north",), standby=frozenset({"north"})),
        ("forward", "not-ready-here", "north", "", False),
    ),
    (
        "new, ready here but residency forbids here: whole to a permitted ready peer",
        facts(ready=("west",), permitted=False),
        ("forward", "not-ready-here", "west", "", False),
    ),
    (
        "new, ready here, residency forbids here, no permitted peer ready: refused",
        facts(permitted=False, placed=True),
        ("refuse", "not-ready-anywhere", "", "", False),
    ),
    (
        "an id naming no cluster: treated as new",
        facts(request_id="whatever-the-client-made-up"),
        ("local", "ready-here", "", "", True),
    ),
    (
        "later hop owned here, step healthy",
        facts("answer", request_id=MINE),
        ("local", "hop-here", "", MINE, False),
    ),
    (
        "later hop owned here, only its own step healthy: stays (busy or not, it queues here)",
        facts("answer", ready_here=frozenset({"chat"}), ready=("west",), request_id=MINE),
        ("local", "hop-here", "", MINE, False),
    ),
    (
        "later hop owned here, step down: refused though a peer is ready (no split)",
        facts("answer", ready_here=frozenset({"emb"}), ready=("west",), request_id=MINE),
        ("refuse", "step-down", "", MINE, False),
    ),
    (
        "later hop owned by a peer where every step is ready: to its owner",
        facts("answer", ready=("west",), request_id=WESTS),
        ("forward", "hop-to-owner", "west", WESTS, False),
    ),
    (
        "later hop owned by a live peer where the pipeline is not ready: refused (an invented id"
        " cannot pick a cluster)",
        facts("answer", request_id=WESTS),
        ("refuse", "owner-unreachable", "", WESTS, False),
    ),
    (
        "later hop owned by a peer not live: refused",
        facts("answer", live=frozenset({"north"}), request_id=WESTS),
        ("refuse", "owner-unreachable", "", WESTS, False),
    ),
    (
        "a peer's forward of a new request: kept here even while not ready (queues)",
        facts(ready_here=frozenset(), forwarded=True),
        ("local", "forwarded-in", "", "", True),
    ),
    (
        "a peer's forward of a hop owned here",
        facts("answer", request_id=MINE, forwarded=True),
        ("local", "forwarded-in", "", MINE, False),
    ),
    (
        "a peer's forward of a hop whose step is down here: refused, never sent on",
        facts("answer", ready_here=frozenset({"emb"}), ready=("north",), request_id=MINE, forwarded=True),
        ("refuse", "step-down", "", MINE, False),
    ),
]


@pytest.mark.parametrize(("case", "f", "want"), TABLE, ids=[t[0] for t in TABLE])
def test_the_hops_route(case: str, f: PipelineFacts, want: tuple) -> None:
    d = decide(f)
    assert (d.action, d.reason, d.peer, d.request_id, d.mint) == want
    if d.action == "refuse":
        assert d.message and (f.pipeline.name in d.message or d.request_id in d.message)


def test_refusals_tell_the_client_what_to_do() -> None:
    down = decide(facts("answer", ready_here=frozenset({"emb"}), request_id=MINE))
    assert "answer" in down.message and "east" in down.message and "restart" in down.message
    nowhere = decide(facts(ready_here=frozenset({"emb"})))
    assert "answer" in nowhere.message and "not ready" in nowhere.message


def test_ids_name_their_owner_and_anything_else_names_none() -> None:
    assert owner_of(MINE) == "east" and owner_of(request_id_for("eu-west-2", "0" * 24)) == "eu-west-2"
    for bad in (None, "", "east", "east.", ".abcdef0123", "East.abcdef0123", "east.xyz", "e." + "a" * 200):
        assert owner_of(bad) is None, bad


def test_ready_peers_keep_the_order_and_need_every_step() -> None:
    ready_in = {"emb": frozenset({"a", "b", "c"}), "chat": frozenset({"c", "a"})}
    assert ready_peers(RAG, ["c", "b", "a"], ready_in) == ("c", "a")
    assert ready_peers(RAG, ["b"], ready_in) == ()


@given(
    ready_here=st.sets(st.sampled_from(["emb", "chat"])),
    ready=st.lists(st.sampled_from(["west", "north"]), unique=True),
    step=st.sampled_from(["embed", "answer"]),
    owner=st.sampled_from([None, "east", "west", "north", "south"]),
    forwarded=st.booleans(),
    placed=st.booleans(),
    permitted=st.booleans(),
    standby=st.sets(st.sampled_from(["east", "west", "north"])),
)
def test_a_hop_never_leaves_for_a_cluster_other_than_its_owner(
    ready_here, ready, step, owner, forwarded, placed, permitted, standby
) -> None:
    """Whatever the facts: a hop owned by a cluster is served there or refused; a new request
    is served here only where every step is ready (or forwarded in), else sent to a ready peer."""
    rid = request_id_for(owner, "ab" * 12) if owner else None
    f = facts(
        step,
        frozenset(ready_here),
        tuple(ready),
        request_id=rid,
        forwarded=forwarded,
        placed=placed,
        permitted=permitted,
        standby_here="east" in standby,
        standby=frozenset(standby - {"east"}),
    )
    d = decide(f)
    if forwarded:
        assert d.action in ("local", "refuse")
    elif owner is None:
        assert d.action != "local" or f.ready or (placed and not ready)
        assert d.action != "local" or permitted  # residency: never admitted here to fail later
        primary = [p for p in ready if p not in standby]
        if d.action == "forward" and primary:  # a standby peer only while no primary is ready
            assert d.peer == primary[0]
        if d.action == "local" and "east" in standby:
            assert not primary
        assert d.action != "forward" or d.peer in ready
    else:
        assert d.action != "local" or owner == "east"
        assert d.action != "forward" or d.peer == owner
