"""Table tests of the routing plan with host-tier hits: a host hit is worth its prefill
less the load back (`fleet_base.kv_tier_cost`), never a device hit; without host tiers the
plan is the device-only plan (tests/agent/gateway/test_plan.py, unchanged)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agent.gateway.inputs import RequestInfo
from agent.gateway.kv_index import KvUpdate, PrefixIndex
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.plan import ClusterFacts, CostModel, PeerFacts, ReplicaFacts, RequestFacts, plan_route
from agent.gateway.prefix import PrefixRouting
from fleet_base.kv_tier_cost import load_token_value, profile_timing
from fleet_base.profile import load_profile

HERE = "east"
PROMPT = tuple(range(100, 164))  # 64 block keys of a 1,024-token prompt (16 a block)
R = CostModel().tokens_per_s  # costs are seconds to first token at the default prefill speed
REQ = RequestFacts("d", prompt_tokens=1024, cost_tokens=1088, block_hashes=PROMPT, block_tokens=16)


def index_with(held: dict[str, tuple[int, int]], cluster: str = HERE) -> PrefixIndex:
    """replica -> (leading blocks on its device, blocks after those in its host tier)."""
    index = PrefixIndex()
    for rid, (device, host) in held.items():
        ops = (("stored", PROMPT[:device], "device"), ("stored", PROMPT[device : device + host], "host"))
        index.apply(KvUpdate(cluster, rid, "d", "e1", 0, ops, snapshot=True))
    return index


@dataclass
class Row:
    name: str
    held: dict[str, tuple[int, int]]
    load: dict[str, int]
    value: float | None  # the replicas' host-token value (None: the model's default, 0.5)
    expect: tuple[tuple[str, str], ...]  # (replica, reason) of the first attempts
    costs: dict[str, float]


ROWS = [
    Row(
        "a host hit beats a miss when loading is cheaper than prefill",
        {"a": (0, 32), "b": (0, 0)},
        {},
        0.75,
        (("a", "prefix"), ("b", "retry")),
        {"a": (1024 - 512 * 0.75) / R, "b": 1024 / R},
    ),
    Row(
        "a device hit beats the same blocks in a host tier",
        {"a": (0, 32), "b": (32, 0)},
        {},
        0.75,
        (("b", "prefix"), ("a", "retry")),
        {"a": (1024 - 384) / R, "b": (1024 - 512) / R},
    ),
    Row(
        "a longer host prefix beats a shorter device one when it saves more",
        {"a": (8, 56), "b": (32, 0)},
        {},
        0.75,
        (("a", "prefix"), ("b", "retry")),
        {"a": (1024 - 128 - 0.75 * 895) / R, "b": (1024 - 512) / R},
    ),
    Row(
        "a tiny bandwidth: a host hit gains nothing, least-load decides",
        {"a": (0, 32), "b": (0, 0)},
        {"a": 10},
        0.0,
        (("b", "least-load"), ("a", "retry")),
        {"a": (1024 + 10) / R, "b": 1024 / R},
    ),
    Row(
        "queued work outweighs a host hit sooner than a device hit",
        {"a": (0, 32), "b": (0, 0)},
        {"a": 400},
        0.5,
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": (1024 - 256 + 400) / R, "b": 1024 / R},
    ),
    Row(
        "... where the same blocks on the device still win",
        {"a": (32, 0), "b": (0, 0)},
        {"a": 400},
        0.5,
        (("a", "prefix"), ("b", "retry")),
        {"a": (1024 - 512 + 400) / R, "b": 1024 / R},
    ),
    Row(
        "an unknown profile takes the model's default value",
        {"a": (0, 32), "b": (0, 0)},
        {"a": 400},
        None,
        (("b", "load-over-prefix"), ("a", "retry")),
        {"a": (1024 - 256 + 400) / R, "b": 1024 / R},
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_host_tier_scoring(row: Row) -> None:
    replicas = tuple(
        ReplicaFacts(
            rid, f"http://{rid}", 1, outstanding_tokens=row.load.get(rid, 0), host_token_value=row.value
        )
        for rid in sorted(row.held)
    )
    plan = plan_route(REQ, ClusterFacts(HERE, replicas), (), index_with(row.held), CostModel())
    local = plan.stage("local")
    assert tuple((a.name, a.reason) for a in local[: len(row.expect)]) == row.expect
    first = {a.name: a for a in local}  # a retry carries its replica's cost and hit
    for rid, cost in row.costs.items():
        assert first[rid].cost == pytest.approx(cost)
        device, host = row.held[rid]
        tokens = min((device + host) * 16, 1023)
        assert first[rid].cached_tokens == tokens  # not prefilled: on the device or loaded
        assert first[rid].host_tokens == tokens - min(device * 16, 1023)


def test_a_peer_host_hit_is_valued_after_its_load() -> None:
    """Leaving the cluster: a peer holding the prefix in its host tier goes first only when
    its saving after the load beats the nearer peer's extra RTT."""
    here = ClusterFacts(HERE)  # no replica here: the request leaves
    near = PeerFacts("south", "http://south", rtt_s=0.02, replica_ids=("s1",))
    far = PeerFacts("west", "http://west", rtt_s=0.05, replica_ids=("w1",))
    index = index_with({"w1": (0, 8)}, cluster="west")
    # 128 host tokens: worth 96 at 0.75 and 12.8 at 0.1 (0.048 s and 0.0064 s at 2,000 tokens a
    # second), against 0.03 s more RTT
    for value, first in ((0.75, "west"), (0.1, "south")):
        model = CostModel(tokens_per_s=2000.0, host_token_value=value)
        plan = plan_route(REQ, here, (near, far), index, model)
        assert plan.attempts[0].name == first
        assert plan.attempts[0].reason == ("peer-prefix" if first == "west" else "no-local-replica")


def test_the_gateway_values_host_hits_by_the_deployments_profile() -> None:
    args = {"gpu": "llama2-70b-h100-tp4", "nope": "no-such-profile"}
    prefix = PrefixRouting(None, HERE, GatewayMetrics(load=dict), engine_arg=lambda d, name: args.get(d))
    value = prefix.host_token_value("gpu")
    assert value == load_token_value(load_profile("llama2-70b-h100-tp4")) and 0.9 < value < 1.0
    assert prefix.timing("gpu") == profile_timing(load_profile("llama2-70b-h100-tp4"))
    for unknown in ("nope", "plain"):  # the cost model's defaults then
        assert prefix.host_token_value(unknown) is None and prefix.timing(unknown) is None


def test_the_gateway_takes_the_long_prefill_cap_from_the_engine_args() -> None:
    profile = "llama2-70b-h100-tp4"  # its batch: 8,192 tokens
    args = {
        "capped": {"profile": profile, "long_prefill_token_threshold": 512, "max_num_batched_tokens": 2048},
        "whole-step": {
            "profile": profile,
            "long_prefill_token_threshold": 2048,
            "max_num_batched_tokens": 2048,
        },
        "profile-budget": {"profile": profile, "long-prefill-token-threshold": "4096"},
        "plain": {"profile": profile},
    }
    prefix = PrefixRouting(
        None,
        HERE,
        GatewayMetrics(load=dict),
        engine_arg=lambda d, name: args[d].get(name, args[d].get(name.replace("_", "-"))),
    )
    found = {d: prefix.timing(d) for d in args}
    assert {d: t.long_threshold for d, t in found.items() if t is not None} == {
        "capped": 512,
        "whole-step": 0,  # a cap of the whole step caps nothing
        "profile-budget": 4096,  # below the profile's batch when the args name no budget
        "plain": 0,  # none in the args: the engine's default (off), whatever the profile says
    }
    assert found["capped"].s_per_token == found["plain"].s_per_token


def test_the_gateway_counts_host_tier_tokens_apart() -> None:
    metrics = GatewayMetrics(load=dict)
    prefix = PrefixRouting(None, HERE, metrics)
    replicas = (ReplicaFacts("a", "http://a", 1, host_token_value=0.75),)
    attempt = plan_route(
        REQ, ClusterFacts(HERE, replicas), (), index_with({"a": (8, 24)}), CostModel()
    ).attempts[0]
    info = RequestInfo("chat", "d", {}, False, False, 1024, 64, 1)
    prefix.count(info, attempt)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"deployment": "d", "replica": "a"})

    assert sample("fleet_gateway_prefix_cached_tokens_total") == 512
    assert sample("fleet_gateway_prefix_host_tokens_total") == 384
