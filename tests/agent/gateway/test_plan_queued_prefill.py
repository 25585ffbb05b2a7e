"""Table tests of the prefix cost's load term: a replica is scored by the request's expected
time to first token there, in seconds (`fleet_base.kv_tier_cost.expected_ttft_s`): the wait
before its prefill starts (the prefills queued there, less what of them is done, then the
step in flight) plus the prefill its cache does not save. A new prompt waits behind the
prefills queued at a replica, not behind its decoding sequences (the engine prefills
first), so `ReplicaFacts.prefill_tokens` (new prefill with no first token yet) is the
queue; decode work only breaks ties. Unknown (None): all outstanding work counts, as
before (tests/agent/gateway/test_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from agent.gateway.exchange import Call
from agent.gateway.inputs import RequestInfo
from agent.gateway.kv_index import KvUpdate, PrefixIndex
from agent.gateway.load import LoadTracker
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.plan import Attempt, ClusterFacts, CostModel, ReplicaFacts, RequestFacts, plan_route
from agent.gateway.upstream import Upstreams
from fleet_base.cluster_config import GatewayConfig
from fleet_base.kv_tier_cost import PrefillTiming, long_prefill_timing

HERE = "east"
PROMPT = tuple(range(100, 164))  # 64 block keys of a 1,024-token prompt (16 a block)
R = CostModel().tokens_per_s  # costs are seconds to first token at the default prefill speed
REQ = RequestFacts("d", prompt_tokens=1024, cost_tokens=1088, block_hashes=PROMPT, block_tokens=16)


@dataclass
class Row:
    name: str
    held: dict[str, int]  # replica -> leading blocks of PROMPT on its device
    load: dict[str, tuple[int, int | None]]  # replica -> (outstanding tokens, of those queued prefill)
    routing: str
    expect: tuple[tuple[str, str], ...]  # (replica, reason) of the first attempts
    costs: dict[str, float] | None = None


ROWS = [
    Row(
        "a holder busy decoding keeps the prefix: its sequences do not delay a prefill",
        {"a": 60, "b": 0},
        {"a": (50_000, 0), "b": (0, 0)},
        "prefix",
        (("a", "prefix"), ("b", "retry")),
        {"a": (1024 - 960) / R, "b": 1024 / R},
    ),
    Row(
        "the same holder with that work unknown (no first tokens seen) loses it",
        {"a": 60, "b": 0},
        {"a": (50_000, None), "b": (0, None)},
        "prefix",
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": (1024 - 960 + 50_000) / R, "b": 1024 / R},
    ),
    Row(
        "prefills queued ahead worth more than the saved prefill send it away",
        {"a": 60, "b": 0},
        {"a": (50_000, 2_100), "b": (3_000, 0)},
        "prefix",
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": (1024 - 960 + 2_100) / R, "b": 1024 / R},
    ),
    Row(
        "a holder keeps the prefix while the prefill queued there costs less than it saves",
        {"a": 60, "b": 0},
        {"a": (900, 900), "b": (0, 0)},
        "prefix",
        (("a", "prefix"), ("b", "retry")),
        {"a": (1024 - 960 + 900) / R, "b": 1024 / R},
    ),
    Row(
        "... and loses it once the queue costs more: the request starts sooner elsewhere",
        {"a": 60, "b": 0},
        {"a": (1_000, 1_000), "b": (0, 0)},
        "prefix",
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": (1024 - 960 + 1_000) / R, "b": 1024 / R},
    ),
    Row(
        "among holders, the one whose queue is shorter",
        {"a": 60, "b": 60},
        {"a": (500, 500), "b": (40_000, 100)},
        "prefix",
        (("b", "prefix"), ("a", "retry")),
        {"a": (1024 - 960 + 500) / R, "b": (1024 - 960 + 100) / R},
    ),
    Row(
        "a prompt nobody holds goes where its prefill starts soonest, decoding work aside",
        {"a": 0, "b": 0},
        {"a": (1_000, 900), "b": (40_000, 0)},
        "prefix",
        (("b", "least-load"), ("a", "retry")),
        {"a": (1024 + 900) / R, "b": 1024 / R},
    ),
    Row(
        "no prefill queued anywhere: the least outstanding work breaks the tie",
        {"a": 0, "b": 0},
        {"a": (9_000, 0), "b": (4_000, 0)},
        "prefix",
        (("b", "least-load"), ("a", "retry")),
    ),
    Row(
        "least-load orders by all outstanding work, prefills or not",
        {"a": 60, "b": 0},
        {"a": (50_000, 0), "b": (100, 100)},
        "least-load",
        (("b", "least-load"), ("a", "retry")),
    ),
]


def _index(held: dict[str, int]) -> PrefixIndex:
    index = PrefixIndex()
    for rid, n in held.items():
        index.apply(KvUpdate(HERE, rid, "d", "e1", 0, (("stored", PROMPT[:n]),), snapshot=True))
    return index


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_queued_prefill_is_the_load(row: Row) -> None:
    replicas = tuple(
        ReplicaFacts(rid, f"http://{rid}", 1, outstanding_tokens=out, prefill_tokens=pre)
        for rid, (out, pre) in sorted(row.load.items())
    )
    plan = plan_route(REQ, ClusterFacts(HERE, replicas), (), _index(row.held), CostModel(routing=row.routing))
    local = plan.stage("local")
    assert tuple((a.name, a.reason) for a in local[: len(row.expect)]) == row.expect
    by_name = {a.name: a for a in local}
    for rid, cost in (row.costs or {}).items():
        assert by_name[rid].cost == pytest.approx(cost)


@dataclass
class WaitRow:
    name: str
    facts: dict[str, tuple[int, float | None, int]]  # replica -> (queued prefill, wait_s, in flight)
    expect: str
    costs: dict[str, float]


T = PrefillTiming(s_per_token=1e-4, step_s=0.03)  # 1,000 tokens: 0.1 s
WAIT_ROWS = [
    WaitRow(
        "a holder whose long prefill is nearly done keeps the prefix (only what is left is waited for)",
        {"a": (20_000, 0.05, 1), "b": (0, 0.0, 0)},
        "a",
        {"a": 0.05 + 0.03 + 0.0064, "b": 0.1024},
    ),
    WaitRow(
        "the same queue just sent sends it away",
        {"a": (20_000, 2.0, 1), "b": (0, 0.0, 0)},
        "b",
        {"a": 2.0 + 0.03 + 0.0064, "b": 0.1024},
    ),
    WaitRow(
        "wait unknown: the queued prefill at the replica's speed",
        {"a": (500, None, 1), "b": (0, 0.0, 0)},
        "a",
        {"a": 0.05 + 0.03 + 0.0064, "b": 0.1024},
    ),
    WaitRow(
        "a step in flight is waited for: between idle holders, the one not decoding",
        {"a": (0, 0.0, 3), "b": (0, 0.0, 0)},
        "b",
        {"a": 0.03 + 0.0064, "b": 0.0064},
    ),
]


@pytest.mark.parametrize("row", WAIT_ROWS, ids=[r.name for r in WAIT_ROWS])
def test_the_wait_is_seconds_at_the_replicas_speed(row: WaitRow) -> None:
    held = {"a": 60, "b": 60 if row.name.startswith("a step") else 0}
    replicas = tuple(
        ReplicaFacts(rid, f"http://{rid}", 1, in_flight=n, prefill_tokens=q, wait_s=w, timing=T)
        for rid, (q, w, n) in sorted(row.facts.items())
    )
    local = plan_route(REQ, ClusterFacts(HERE, replicas), (), _index(held), CostModel()).stage("local")
    assert local[0].name == row.expect
    by_name = {a.name: a for a in local}
    for rid, cost in row.costs.items():
        assert by_name[rid].cost == pytest.approx(cost)


def test_a_short_prefill_is_scored_by_the_short_wait_where_the_engine_lets_it_past() -> None:
    # The holder has a 2 s long prefill queued; the request needs 64 new tokens there (short
    # under a 512-token cap) and 1,024 elsewhere (long): the holder wins by the short wait.
    capped = long_prefill_timing(T, 512, 2048)
    replicas = (
        ReplicaFacts("a", "http://a", 1, in_flight=1, wait_s=2.0, short_wait_s=0.0, timing=capped),
        ReplicaFacts("b", "http://b", 1, wait_s=0.0, short_wait_s=0.0, timing=capped),
    )
    local = plan_route(REQ, ClusterFacts(HERE, replicas), (), _index({"a": 60}), CostModel()).stage("local")
    assert local[0].name == "a"
    assert {x.name: x.cost for x in local} == pytest.approx({"a": 0.03 + 0.0064, "b": 0.1024})
    # Without the cap the same holder is scored by the whole queue, and loses.
    plain = tuple(
        ReplicaFacts(r.replica_id, r.url, 1, in_flight=r.in_flight, wait_s=r.wait_s, timing=T)
        for r in replicas
    )
    assert (
        plan_route(REQ, ClusterFacts(HERE, plain), (), _index({"a": 60}), CostModel()).stage("local")[0].name
        == "b"
    )


def test_tracker_releases_prefill_at_the_first_token_and_the_rest_at_the_finish() -> None:
    tracker = LoadTracker()
    tracker.start("r1", 1088, 1024)
    tracker.start("r1", 600, 500)
    assert (tracker.outstanding("r1"), tracker.queued_prefill("r1")) == (1688, 1524)
    tracker.prefilled("r1", 1024)  # the first request's first token
    assert (tracker.outstanding("r1"), tracker.queued_prefill("r1")) == (1688, 500)
    tracker.finish("r1", 1088)  # its prefill was released already
    tracker.finish("r1", 600, 500)  # never streamed a token: released with the rest
    assert tracker.snapshot() == {} and tracker.queued_prefill("r1") == 0


def test_tracker_keeps_each_queued_prefill_with_when_it_was_sent() -> None:
    now = [10.0]
    tracker = LoadTracker(clock=lambda: now[0])
    tracker.start("r1", 1088, 1024)
    now[0] = 10.5
    tracker.start("r1", 600, 500)
    tracker.start("r1", 50, 0)  # nothing to prefill: nothing queued
    assert tracker.pending_prefill("r1") == ((10.0, 1024), (10.5, 500))
    tracker.prefilled("r1", 500)  # first tokens may come out of order
    assert tracker.pending_prefill("r1") == ((10.0, 1024),)
    tracker.finish("r1", 1088, 1024)
    assert tracker.pending_prefill("r1") == ()


def test_replica_facts_give_the_short_wait_where_the_replica_has_a_cap() -> None:
    from prometheus_client import CollectorRegistry

    from agent.gateway.adapters import AdapterRouting
    from agent.gateway.router import replica_facts
    from tests.agent.gateway.harness import replica

    now = [10.0]
    tracker = LoadTracker(clock=lambda: now[0])
    tracker.start("r1", 20_100, 20_000)  # a long prefill (2 s at T's speed) just sent there
    adapters = AdapterRouting(CollectorRegistry())
    capped = replica_facts(replica("r1", "http://r1"), tracker, adapters, long_prefill_timing(T, 512, 2048))
    assert capped.wait_s == pytest.approx(2.0)
    assert capped.short_wait_s == pytest.approx(0.0512)  # only the step its 512 tokens share
    plain = replica_facts(replica("r1", "http://r1"), tracker, adapters, T)
    assert plain.wait_s == pytest.approx(2.0) and plain.short_wait_s is None


def test_an_attempt_queues_its_new_prefill_until_its_first_token() -> None:
    """The gateway's side: an attempt sent to a replica adds its new prefill (the prompt
    less the cached prefix) to the replica's queued prefill; a stream's first token takes
    it off, and the release takes whatever is left, once."""
    tracker = LoadTracker()
    ups = Upstreams("east", GatewayConfig(), SimpleNamespace(replica_headers={}), tracker, GatewayMetrics())
    info = RequestInfo("chat", "d", {}, True, False, prompt_tokens=1024, max_tokens=64, sequences=1)
    target = Attempt("local", "prefix", "r1", "http://r1", 1, cached_tokens=960)
    streamed, whole = Call("q1", "k", info, 0.0), Call("q2", "k", info, 0.0)
    ups.headers(streamed, target)
    ups.headers(whole, target)
    assert tracker.queued_prefill("r1") == 2 * 64 and tracker.outstanding("r1") == 2 * (1088 - 960)
    ups.first_token(streamed, target)
    ups.first_token(streamed, target)  # every later event says so again: taken off once
    assert tracker.queued_prefill("r1") == 64
    ups.release(streamed, target)
    assert tracker.queued_prefill("r1") == 64 and tracker.in_flight("r1") == 1
    ups.release(whole, target)  # never streamed a token: its prefill leaves with it
    assert tracker.snapshot() == {} and tracker.queued_prefill("r1") == 0 and not ups.prefilling
