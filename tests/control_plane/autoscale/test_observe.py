"""Heartbeats and gateway demand -> one Observation per deployment; version columns ->
settings; routes of deployments that may scale to zero."""

from __future__ import annotations

import asyncio

import pytest

from agent.gateway.demand import DemandSignal
from control_plane.autoscale.observe import OBSERVED_PROMPTS, observe, settings_of
from control_plane.autoscale.policy import AutoscaleSettings, ScalerState, make_policy
from control_plane.db.models import CapacityPool, DeploymentVersion
from control_plane.fleet_model.plan import build_routes
from control_plane.fleet_model.snapshot import DeploymentRow, FleetSnapshot, VersionSpec
from fleet_base.protocol import Demand, Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus


def rs(rid: str, dep: str, state: ReplicaState, running: int = 0, waiting: int = 0) -> ReplicaStatus:
    return ReplicaStatus(replica_id=rid, deployment=dep, version=1, state=state,
                         load=ReplicaLoad(running=running, waiting=waiting))  # fmt: skip


def test_observe_sums_clusters_and_fresh_demand() -> None:
    now = 1000.0
    hbs = [
        Heartbeat(cluster="a", sent_at=now - 1, replicas=[
            rs("a1", "chat", ReplicaState.ready, 3, 1), rs("a2", "chat", ReplicaState.starting),
            rs("a3", "code", ReplicaState.ready, 9, 9)]),
        Heartbeat(cluster="b", sent_at=now - 2, replicas=[rs("b1", "chat", ReplicaState.ready, 2, 0)]),
        Heartbeat(cluster="c", sent_at=now - 60, replicas=[rs("c1", "chat", ReplicaState.ready, 50, 50)]),  # stale
    ]  # fmt: skip
    demands = {
        ("a", "chat"): Demand(cluster="a", deployment="chat", queued=4, at=now - 1),
        ("b", "chat"): Demand(cluster="b", deployment="chat", queued=7, at=now - 30),  # expired
    }
    obs = observe("chat", hbs, demands, now=now, current=3)
    assert (obs.in_flight, obs.queued, obs.ready, obs.starting, obs.current) == (5, 5, 2, 1, 3)
    assert observe("none", hbs, demands, now=now, current=0).demand == 0


@pytest.mark.parametrize(
    ("reports", "queued"),
    [
        pytest.param([("a", 0, 9, 1), ("b", 0, 9, 1)], 9, id="same backlog from two clusters counts once"),
        pytest.param([("a", 0, 9, 1), ("b", 0, 6, 1)], 9, id="clusters read at different times: the largest"),
        pytest.param([("a", 2, 9, 1), ("b", 3, 9, 1)], 2 + 3 + 9, id="own waiting requests still add up"),
        pytest.param([("a", 0, 9, 1), ("b", 0, 50, 30)], 9, id="a stale report is left out"),
        pytest.param([("a", 0, 0, 30), ("b", 0, 0, 30)], 0, id="only stale reports: no demand"),
        pytest.param([("a", 0, 7, 1)], 7, id="backlog alone is demand"),
    ],
)
def test_the_batch_backlog_counts_once_per_deployment(
    reports: list[tuple[str, int, int, float]], queued: int
) -> None:
    now = 1000.0
    demands = {
        (c, "chat"): Demand(cluster=c, deployment="chat", queued=q, batch_backlog=b, at=now - age)
        for c, q, b, age in reports
    }
    demands[("a", "code")] = Demand(cluster="a", deployment="code", batch_backlog=100, at=now)  # another
    assert observe("chat", [], demands, now=now, current=1).queued == queued


def test_a_backlog_with_no_replica_asks_to_scale_from_zero() -> None:
    now = 1000.0
    demands = {
        ("a", "chat"): Demand(cluster="a", deployment="chat", batch_backlog=40, at=now),
        ("b", "chat"): Demand(cluster="b", deployment="chat", batch_backlog=40, at=now),
    }
    obs = observe("chat", [], demands, now=now, current=0)
    settings = AutoscaleSettings(min_replicas=0, max_replicas=8, target_concurrency=10)
    for name in ("ours", "kpa", "slo"):
        decision = make_policy(name).decide(settings, ScalerState(), obs)
        assert obs.queued == 40 and obs.ready == 0 and decision.desired >= 1, (name, decision.reason)


def test_settings_of_a_version_row() -> None:
    v = DeploymentVersion(version=1, model="m", min_replicas=0, max_replicas=4, autoscale_window_s=30.0,
                          scale_down_delay_s=10.0, target_concurrency=6.0, scale_to_zero=False)  # fmt: skip
    s = settings_of(v)
    assert (s.min_replicas, s.max_replicas, s.target_concurrency) == (0, 4, 6.0)
    assert s.stable_window_s == 30 and s.panic_window_s == 3 and s.scale_down_delay_s == 10
    assert s.scale_to_zero  # min 0 means it may reach zero


def test_routes_stay_for_a_deployment_that_scales_to_zero() -> None:
    snap = FleetSnapshot(
        deployments=(DeploymentRow(name="zero", replicas=0, current_version=1),
                     DeploymentRow(name="off", replicas=0, current_version=1)),
        specs={("zero", 1): VersionSpec(deployment="zero", version=1, model="m", min_replicas=0),
               ("off", 1): VersionSpec(deployment="off", version=1, model="m", min_replicas=1)},
    )  # fmt: skip
    routes = build_routes(snap, [])
    assert set(routes) == {"zero"} and routes["zero"].scale_to_zero and routes["zero"].clusters == []


def test_demand_signal_counts_waiters_and_sends_at_once_from_zero() -> None:
    sent: list[Demand] = []

    class Link:
        async def publish(self, subject: str, message: Demand) -> bool:
            assert subject == "fleet.v1.demand.a"
            sent.append(message)
            return True

    async def go() -> None:
        sig = DemandSignal(Link(), "a", every_s=60)  # type: ignore[arg-type]
        with sig.waiting("chat", ready=0):
            with sig.waiting("chat", ready=0):
                assert sig.queued == {"chat": 2}
            await asyncio.sleep(0)
        assert sig.queued == {}
        with sig.waiting("code", ready=2):  # first for this deployment: sent
            with sig.waiting("code", ready=2):  # within every_s and replicas ready: not sent
                await asyncio.sleep(0)

    asyncio.run(go())
    assert [(d.deployment, d.queued, d.ready) for d in sent] == [
        ("chat", 1, 0),
        ("chat", 2, 0),
        ("code", 1, 2),
    ]


def test_observe_sums_work_and_weights_ttft_by_requests() -> None:
    now = 1000.0
    busy = ReplicaLoad(running=4, prompt_tokens_per_s=3000, tokens_per_s=400, requests_per_s=3, ttft_s=0.5,
                       kv_cache_usage=0.6)  # fmt: skip
    calm = ReplicaLoad(running=1, prompt_tokens_per_s=1000, tokens_per_s=100, requests_per_s=1, ttft_s=0.1,
                       kv_cache_usage=0.2)  # fmt: skip
    hb = Heartbeat(cluster="a", sent_at=now, replicas=[
        ReplicaStatus(replica_id="x", deployment="chat", version=1, state=ReplicaState.ready, load=busy),
        ReplicaStatus(replica_id="y", deployment="chat", version=1, state=ReplicaState.ready, load=calm)])  # fmt: skip
    obs = observe("chat", [hb], {}, now=now, current=2)
    assert (obs.requests_per_s, obs.prompt_tokens_per_s, obs.output_tokens_per_s) == (4, 4000, 500)
    assert obs.ttft_s == pytest.approx((3 * 0.5 + 1 * 0.1) / 4) and obs.kv_usage == pytest.approx(0.4)


def test_settings_carry_the_profile_targets_and_variants_over_pools() -> None:
    v = DeploymentVersion(version=1, model="m", min_replicas=1, max_replicas=9, gpu_count=4, gpu_models=[],
                          autoscale_window_s=60.0, scale_down_delay_s=90.0, target_concurrency=8.0,
                          engine_args={"profile": "llama2-70b-h100-tp4", "profile_a100": "llama2-70b-a100-tp4",
                                       "profile_l4": "no-such-profile", "cold_start": 5},
                          slo_ttft_s=1.5, slo_itl_s=0.05)  # fmt: skip
    one = settings_of(v)
    assert one.profile is not None and one.profile.name == "llama2-70b-h100-tp4"
    assert one.profile.cold_start_s == 5 and (one.slo_ttft_s, one.slo_itl_s) == (1.5, 0.05)
    assert one.variants == []  # no pools: nothing to choose among
    pools = [
        CapacityPool(name="h", gpu_model="H100", gpus_per_node=8, nodes=2, hourly_price=80.0),
        CapacityPool(name="a", gpu_model="a100", gpus_per_node=8, nodes=1, hourly_price=30.0),
        CapacityPool(name="a-cheap", gpu_model="A100", gpus_per_node=4, nodes=1, hourly_price=10.0),
    ]
    s = settings_of(v, pools=pools)
    by = {x.name: x for x in s.variants}
    assert set(by) == {"A100", "H100"}
    assert by["A100"].hourly_price == pytest.approx(10.0) and by["A100"].max_replicas == 3  # (8 + 4) / 4
    assert by["H100"].hourly_price == pytest.approx(40.0) and by["H100"].max_replicas == 4
    v.gpu_models = ["H100"]
    assert settings_of(v, pools=pools).variants == []  # one allowed type: no choice
    v.slo_ttft_s = None
    assert settings_of(v).slo_ttft_s == 2.0  # the documented default


def test_the_placer_receives_the_autoscalers_gpu_mix() -> None:
    from control_plane.fleet_model.plan import placement_inputs
    from control_plane.fleet_model.snapshot import ClusterRow, PoolRow
    from control_plane.placement.ffd import FirstFitDecreasing

    spec = VersionSpec(deployment="chat", version=1, model="m", gpu_models=("H100", "A100"), gpu_count=4)
    pools = (PoolRow(name="h", gpu_model="H100", gpus_per_node=8, nodes=2, hourly_price=8 * 10.0),
             PoolRow(name="a", gpu_model="A100", gpus_per_node=8, nodes=2, hourly_price=8 * 4.0))  # fmt: skip
    cluster = ClusterRow(id="c", region="r", pools=pools)
    free = FleetSnapshot(deployments=(DeploymentRow(name="chat", replicas=3, current_version=1),),
                         specs={("chat", 1): spec}, clusters=(cluster,))  # fmt: skip
    demands, _, _ = placement_inputs(free)
    assert demands[0].gpu_models == ("H100", "A100")  # no mix: the version's own choice
    mixed = free.model_copy(
        update={
            "deployments": (
                DeploymentRow(name="chat", replicas=3, current_version=1, variant_mix={"A100": 3}),
            )
        }
    )
    demands, pools_in, current = placement_inputs(mixed)
    assert demands[0].gpu_models == ("A100",) and demands[0].count == 3
    result = FirstFitDecreasing().place(demands, pools_in, current)
    assert {a.pool for a in result.assignments} == {"a"}


def test_shadow_replicas_are_no_demand() -> None:
    """A shadow phase's replicas run copies: their load and readiness never scale the deployment."""
    shadow = ReplicaStatus(replica_id="s1", deployment="chat", version=2, state=ReplicaState.ready,
                           load=ReplicaLoad(running=8, waiting=4, requests_per_s=5.0))  # fmt: skip
    hbs = [
        Heartbeat(cluster="a", sent_at=999.0, replicas=[rs("a1", "chat", ReplicaState.ready, 3, 1), shadow])
    ]
    counted = observe("chat", hbs, {}, now=1000.0, current=2)
    assert (counted.in_flight, counted.queued, counted.ready) == (11, 5, 2)
    left_out = observe("chat", hbs, {}, now=1000.0, current=2, shadow_versions=frozenset({2}))
    assert (left_out.in_flight, left_out.queued, left_out.ready, left_out.requests_per_s) == (3, 1, 1, 0.0)


def test_observe_takes_the_slowest_measured_cold_start_of_the_deployment() -> None:
    now = 1000.0
    measured = lambda rid, dep, s: ReplicaStatus(  # noqa: E731
        replica_id=rid, deployment=dep, version=1, state=ReplicaState.ready, cold_start_s=s
    )
    hbs = [
        Heartbeat(cluster="a", sent_at=now - 1, replicas=[measured("a1", "chat", 42.0), measured("a2", "chat", 71.5),
                                                          measured("a3", "code", 500.0)]),
        Heartbeat(cluster="b", sent_at=now - 1, replicas=[measured("b1", "chat", 1e9)]),  # broken: left out
    ]  # fmt: skip
    assert observe("chat", hbs, {}, now=now, current=2).cold_start_s == 71.5
    assert observe("chat", [], {}, now=now, current=0).cold_start_s is None


def test_the_prompt_mix_is_every_ready_replicas_sample() -> None:
    now = 1000.0
    hb = Heartbeat(cluster="a", sent_at=now, replicas=[
        ReplicaStatus(replica_id="x", deployment="chat", version=1, state=ReplicaState.ready,
                      load=ReplicaLoad(requests_per_s=2, prompt_sample=(700, 5800))),
        ReplicaStatus(replica_id="y", deployment="chat", version=1, state=ReplicaState.starting,
                      load=ReplicaLoad(prompt_sample=(99,))),
        ReplicaStatus(replica_id="z", deployment="other", version=1, state=ReplicaState.ready,
                      load=ReplicaLoad(prompt_sample=(42,)))])  # fmt: skip
    stale = Heartbeat(cluster="b", sent_at=now - 60, replicas=[
        ReplicaStatus(replica_id="w", deployment="chat", version=1, state=ReplicaState.ready,
                      load=ReplicaLoad(prompt_sample=(1,)))])  # fmt: skip
    assert observe("chat", [hb, stale], {}, now=now, current=1).prompt_sample == (700, 5800)
    # A busy replica's lengths stand for more requests than an idle one's, and the whole mix
    # is a bounded set of quantiles: sorted, spread over both replicas' lengths.
    busy = ReplicaLoad(requests_per_s=9, prompt_sample=tuple(range(1000, 1064)))
    idle = ReplicaLoad(requests_per_s=1, prompt_sample=tuple(range(1, 65)))
    both = Heartbeat(cluster="c", sent_at=now, replicas=[
        ReplicaStatus(replica_id="b", deployment="chat", version=1, state=ReplicaState.ready, load=busy),
        ReplicaStatus(replica_id="i", deployment="chat", version=1, state=ReplicaState.ready, load=idle)])  # fmt: skip
    mix = observe("chat", [both], {}, now=now, current=2).prompt_sample
    assert len(mix) == OBSERVED_PROMPTS and list(mix) == sorted(mix)
    assert sum(1 for x in mix if x >= 1000) == round(0.9 * OBSERVED_PROMPTS)
    assert mix[0] < 64 and mix[-1] >= 1060  # both ends of the mix, not one replica's low half
    with pytest.raises(ValueError):
        ReplicaLoad(prompt_sample=tuple(range(1, 100)))  # bounded on the wire
