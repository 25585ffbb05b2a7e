"""LoRA routing as pure functions: the plan prefers replicas holding the adapter, then room,
then eviction; the agent's preload spread and the eviction choice; the reconciler applies a
changed adapter catalog without restarting replicas."""

from __future__ import annotations

import pytest

from agent.adapters import eviction_victim, spread
from agent.gateway.plan import ClusterFacts, CostModel, ReplicaFacts, RequestFacts, plan_route
from agent.reconciler import ReplicaRecord, Stop, plan
from fleet_base.protocol import DesiredState, LoRAAdapterSpec, ReplicaSpec, ReplicaState

LEAST = CostModel(routing="least-load")


def _replica(rid: str, adapters: tuple[str, ...] = (), room: int = 2, load: int = 0) -> ReplicaFacts:
    return ReplicaFacts(rid, f"http://{rid}", 1, outstanding_tokens=load, adapters=frozenset(adapters),
                        max_adapters=room)  # fmt: skip


def _local(adapter: str | None, *replicas: ReplicaFacts):
    request = RequestFacts("d", prompt_tokens=10, cost_tokens=20, adapter=adapter)
    return plan_route(request, ClusterFacts("c", replicas), [], model=LEAST).stage("local")


@pytest.mark.parametrize(
    ("replicas", "first", "reason", "load"),
    [
        # resident wins even when busier
        ((_replica("a", ("x",), load=500), _replica("b", load=0)), "a", "adapter-resident", ""),
        # nowhere resident: the least-loaded replica with room loads it
        ((_replica("a", ("p", "q"), load=0), _replica("b", ("p",), load=90), _replica("c", load=100)),
         "b", "adapter-load", "x"),
        # every replica full: the least loaded evicts
        ((_replica("a", ("p", "q"), load=50), _replica("b", ("r", "s"), load=10)), "b", "adapter-evict", "x"),
    ],
)  # fmt: skip
def test_plan_prefers_resident_then_room_then_eviction(replicas, first, reason, load):
    attempts = _local("x", *replicas)
    assert (attempts[0].name, attempts[0].reason, attempts[0].load_adapter) == (first, reason, load)


def test_base_requests_ignore_adapters_and_lora_off_replicas_never_get_adapter_requests():
    attempts = _local(None, _replica("a", ("x",), load=50), _replica("b", load=10))
    assert attempts[0].name == "b" and attempts[0].reason == "least-load"
    attempts = _local("x", _replica("off", room=0, load=0), _replica("on", ("y",), load=99))
    assert {a.name for a in attempts} == {"on"}


def test_spread_puts_every_adapter_somewhere_while_there_is_room():
    share = spread(["a0", "a1", "a2", "a3", "a4"], ["r1", "r0"], 2)
    assert share == {"r0": ["a0", "a2"], "r1": ["a1", "a3"]}  # a4: no room; loaded on demand
    assert spread(["a"], [], 2) == {} and spread(["a"], ["r"], 0) == {"r": []}


def test_eviction_takes_the_least_recently_used_other_adapter():
    assert eviction_victim(["p", "q", "x"], {"p": 5.0, "q": 1.0, "x": 0.0}, keep="x") == "q"
    assert eviction_victim(["p", "q"], {"p": 5.0}, keep="x") == "q"  # never used goes first
    assert eviction_victim(["x"], {}, keep="x") is None


def test_a_changed_adapter_catalog_restarts_nothing_but_max_adapters_does():
    spec = ReplicaSpec(replica_id="r", deployment="d", version=1, model="m", max_adapters=2,
                       adapters=[LoRAAdapterSpec(name="a", uri="/a")])  # fmt: skip
    record = ReplicaRecord(replica_id="r", spec=spec, state=ReplicaState.ready)
    more = spec.model_copy(update={"adapters": [*spec.adapters, LoRAAdapterSpec(name="b", uri="/b")]})
    assert plan(DesiredState(cluster="c", replicas=[more]), [record], 0.0) == []
    room = spec.model_copy(update={"max_adapters": 4})
    assert any(isinstance(a, Stop) for a in plan(DesiredState(cluster="c", replicas=[room]), [record], 0.0))


def test_an_adapter_has_its_own_limits_on_top_of_the_deployments():
    from agent.gateway.quota import limits_for
    from fleet_base.api_keys import DeploymentLimits, Quotas

    q = Quotas(tokens_per_minute=1000, deployments={"d": DeploymentLimits(requests_per_minute=10),
                                                    "sql": DeploymentLimits(tokens_per_minute=50)})  # fmt: skip
    assert [lim.name for lim in limits_for(q, "d", 1.0)] == ["tpm", "d:rpm"]
    assert [lim.name for lim in limits_for(q, "d", 1.0, adapter="sql")] == ["tpm", "d:rpm", "sql:tpm"]
