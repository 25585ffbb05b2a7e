"""Static sizing: a static deployment run alone gets the replicas the capacity model needs
at the trace's busiest minute, not `max_replicas`."""

from __future__ import annotations

from agent.sim.profile import PerfProfile
from control_plane.autoscale import AutoscaleSettings
from control_plane.autoscale.capacity import Load, ReplicaCapacity
from control_plane.autoscale.slo import meets
from control_plane.simulate import compare
from control_plane.simulate.sizing import peak_size
from control_plane.simulate.trace import TraceRequest

PROFILE = PerfProfile(
    name="t",
    prefill_tokens=[100.0, 2000.0],
    prefill_s=[0.02, 0.4],
    decode_batch=[1.0, 16.0],
    decode_step_s=[0.01, 0.02],
    kv_capacity_tokens=200_000,
    max_num_seqs=16,
)
SETTINGS = AutoscaleSettings(min_replicas=1, max_replicas=50, target_concurrency=8)


def steady(rate: float, seconds: float, start: float = 0.0, prompt: int = 1500) -> list[TraceRequest]:
    return [TraceRequest(start + i / rate, prompt, 40) for i in range(int(rate * seconds))]


def test_sized_for_the_busiest_minute_and_no_fewer() -> None:
    quiet = peak_size(steady(2.0, 600), PROFILE, SETTINGS)
    burst = steady(2.0, 300) + steady(12.0, 120, start=300) + steady(2.0, 300, start=420)
    peak = peak_size(burst, PROFILE, SETTINGS)
    assert 1 <= quiet.replicas < peak.replicas < SETTINGS.max_replicas
    assert 240 <= peak.window_start_s <= 420 and "busiest 60 s" in peak.why and "meets" in peak.why
    # At the burst's load the count meets the targets and one replica fewer does not.
    window = [r for r in burst if 330 <= r.at < 390]
    load = Load(
        len(window) / 60, sum(r.prompt_tokens for r in window) / 60, sum(r.output_tokens for r in window) / 60
    )
    cap = ReplicaCapacity(PROFILE)
    predict = lambda n: cap.predict(load, n, 1.0, [r.prompt_tokens for r in window], SETTINGS.slo_ttft_s)  # noqa: E731
    assert meets(predict(peak.replicas), SETTINGS) and not meets(predict(peak.replicas - 1), SETTINGS)


def test_bounded_by_min_and_max_replicas() -> None:
    heavy = steady(40.0, 120)
    capped = peak_size(heavy, PROFILE, SETTINGS.model_copy(update={"max_replicas": 3}))
    assert capped.replicas == 3 and "capped" in capped.why
    floor = peak_size(steady(0.1, 120), PROFILE, SETTINGS.model_copy(update={"min_replicas": 5}))
    assert floor.replicas == 5
    assert peak_size([], PROFILE, SETTINGS).replicas == 1


def test_static_alone_runs_at_the_sized_count_for_every_routing() -> None:
    trace = steady(2.0, 200) + steady(10.0, 60, start=200) + steady(2.0, 100, start=260)
    size = peak_size(trace, PROFILE, SETTINGS)
    rep = compare(
        trace, PROFILE, SETTINGS, policies=("static",), routings=("least-load", "prefix"), warmup_s=0
    )
    assert rep.static_replicas == size.replicas < SETTINGS.max_replicas
    assert rep.static_sizing == size.why
    assert [(p.routing, p.replicas_max) for p in rep.policies] == [
        ("least-load", size.replicas),
        ("prefix", size.replicas),
    ]
    fixed = compare(trace, PROFILE, SETTINGS, policies=("static",), static_replicas=7, warmup_s=0)
    assert fixed.static_replicas == 7 and fixed.static_sizing == "--replicas"
    assert fixed.policies[0].replicas_max == 7
