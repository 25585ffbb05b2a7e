"""Table tests of the prefix cost's load term: a new prompt waits behind the prefills
queued at a replica, not behind its decoding sequences (the engine prefills first), so
`ReplicaFacts.prefill_tokens` (new prefill with no first token yet) is the load the saved
prefill is weighed against; decode work only breaks ties (and orders a prompt nobody holds
any of, as least-load does). Unknown (None): all outstanding
work counts, as before (tests/agent/gateway/test_plan.py). The new prefill counts twice
(`fleet_base.kv_tier_cost.NEW_PREFILL_WEIGHT`: the request's wait, and work the replica's
later requests wait behind), the queued prefill once."""

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

HERE = "east"
PROMPT = tuple(range(100, 164))  # 64 block keys of a 1,024-token prompt (16 a block)
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
        {"a": 2 * (1024 - 960) + 0, "b": 2 * 1024},
    ),
    Row(
        "the same holder with that work unknown (no first tokens seen) loses it",
        {"a": 60, "b": 0},
        {"a": (50_000, None), "b": (0, None)},
        "prefix",
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": 2 * (1024 - 960) + 50_000, "b": 2 * 1024},
    ),
    Row(
        "prefills queued ahead worth more than the saved prefill send it away",
        {"a": 60, "b": 0},
        {"a": (50_000, 2_100), "b": (3_000, 0)},
        "prefix",
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": 2 * (1024 - 960) + 2_100, "b": 2 * 1024},
    ),
    Row(
        "a holder keeps the prefix until the prefill queued there passes twice what it saves",
        {"a": 60, "b": 0},
        {"a": (1_900, 1_900), "b": (0, 0)},
        "prefix",
        (("a", "prefix"), ("b", "retry")),
        {"a": 2 * (1024 - 960) + 1_900, "b": 2 * 1024},
    ),
    Row(
        "a prompt nobody holds goes in least-load's order, decoding work included",
        {"a": 0, "b": 0},
        {"a": (1_000, 900), "b": (40_000, 0)},
        "prefix",
        (("a", "least-load"), ("b", "retry")),
        {"a": 2 * 1024 + 1_000, "b": 2 * 1024 + 40_000},
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
