"""Table tests of the SLO-driven policy (`slo`, the default `ours`): a work series in
(requests/s, prompt and output lengths), desired replicas out, on the Llama2-70B H100
profile. Replicas become ready at once here, so each tick's `ready` and `current` are
the previous decision."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from control_plane.autoscale import AutoscaleSettings, Observation, ScalerState, make_policy
from control_plane.autoscale.capacity import Load, ReplicaCapacity, Variant
from control_plane.autoscale.slo import meets, smallest
from fleet_base.profile import load_profile
from tests.control_plane.autoscale.helpers import series

H100 = load_profile("llama2-70b-h100-tp4")
A100 = load_profile("llama2-70b-a100-tp4")


@dataclass(frozen=True)
class Work:
    rps: float
    prompt: int
    output: int
    in_flight: float | None = None  # None: what the load would hold (Little's law, roughly)
    queued: float = 0.0


def run(
    policy: str,
    work: list[tuple[float, Work]],
    start: int = 1,
    cold_start_s: float | None = None,
    state: ScalerState | None = None,
    **settings: object,
):
    s = AutoscaleSettings(
        **{"profile": H100, "max_replicas": 40, "target_concurrency": 64.0, "policy": policy, **settings}
    )
    p, current = make_policy(policy), start
    state = state if state is not None else ScalerState()
    out = []
    for t, w in work:
        in_flight = w.in_flight if w.in_flight is not None else w.rps * (0.1 + w.output * 0.04)
        obs = Observation(
            at=t,
            in_flight=in_flight,
            queued=w.queued,
            ready=current,
            current=current,
            requests_per_s=w.rps,
            prompt_tokens_per_s=w.rps * w.prompt,
            output_tokens_per_s=w.rps * w.output,
            prompt_sample=(w.prompt,) * 4 if w.rps else (),
            cold_start_s=cold_start_s,
        )
        d = p.decide(s, state, obs)
        out.append((t, d.desired, d))
        current = d.desired
    return out


def at(result, t: float) -> int:
    return next(d for tt, d, _ in result if tt >= t)


def test_steady_token_load_settles_at_the_smallest_count_meeting_both_targets() -> None:
    r = run("slo", series((0, 400, Work(6.0, 1000, 200))))
    settled = {d for t, d, _ in r if t >= 100}
    assert len(settled) == 1
    n = settled.pop()
    s = AutoscaleSettings(profile=H100)
    load = Load(6.0, 6000, 1200)
    cap = ReplicaCapacity(H100)
    prompts = [1000] * 4
    assert meets(cap.predict(load, n, 1.0, prompts, s.slo_ttft_s), s)
    assert not meets(cap.predict(load, n - 1, 1.0, prompts, s.slo_ttft_s), s)
    assert n == smallest(cap, load, s, 40, 1.0, prompts)[0]
    last = r[-1][2]
    assert "TTFT" in last.reason and "ITL" in last.reason
    assert last.predicted["itl_s"] <= s.slo_itl_s and last.predicted["feasible"] is True


def test_prompt_length_shift_at_constant_rate_and_concurrency_scales_up() -> None:
    # The same 4 req/s and the same 12 requests in flight; prompts go from 400 to 4000
    # tokens: ten times the prefill work. Concurrency-driven policies see nothing.
    work = series((0, 300, Work(4.0, 400, 60, in_flight=12)), (300, 600, Work(4.0, 4000, 60, in_flight=12)))
    slo = run("slo", work)
    before, after = at(slo, 290), at(slo, 400)
    assert after >= 2 * before and after >= 3
    assert any("prompt" in d.reason for t, _, d in slo if t >= 300)
    for name in ("concurrency", "kpa"):
        old = run(name, work, target_concurrency=16.0)
        assert at(old, 400) == at(old, 290)  # blind to the shift


def test_burst_scales_up_within_seconds_and_holds_through_the_delay() -> None:
    calm, burst = Work(3.0, 1000, 200), Work(15.0, 1000, 200)
    r = run("slo", series((0, 200, calm), (200, 240, burst), (240, 600, calm)))
    base = at(r, 190)
    assert at(r, 206) > base  # within three decisions of the burst
    peak = max(d for t, d, _ in r if 200 <= t < 260)
    assert peak >= 3 * base
    assert at(r, 300) >= peak - 1  # the 90 s scale-down delay holds it
    assert at(r, 590) == base
    assert any("scale-down delay" in d.reason for _, _, d in r)


def test_diurnal_decay_follows_the_load_down_without_oscillating() -> None:
    work = [(float(t), Work(12.0 - 10.0 * t / 1200, 1500, 250)) for t in range(0, 1500, 3)]
    r = run("slo", work, start=10)
    seq = [d for t, d, _ in r if t >= 120]
    assert all(b <= a for a, b in itertools.pairwise(seq))  # only down as the load falls
    assert seq[0] >= 3 * seq[-1] and seq[-1] >= 1


def test_variant_choice_by_price_and_room() -> None:
    load_work = series((0, 120, Work(8.0, 1500, 200)))
    cheap_a100 = [
        Variant(name="h100", profile=H100, hourly_price=27.92),
        Variant(name="a100", profile=A100, hourly_price=14.68),
    ]
    d = run("slo", load_work, variants=cheap_a100)[-1][2]
    n_h = smallest(ReplicaCapacity(H100), Load(8, 12000, 1600), AutoscaleSettings(), 40, 1.0, [1500] * 4)[0]
    n_a = smallest(ReplicaCapacity(A100), Load(8, 12000, 1600), AutoscaleSettings(), 40, 1.0, [1500] * 4)[0]
    cheaper = "a100" if n_a * 14.68 < n_h * 27.92 else "h100"
    assert d.mix == {cheaper: {"a100": n_a, "h100": n_h}[cheaper]} and d.desired == sum(d.mix.values())
    assert "mix:" in d.reason and d.as_dict()["mix"] == d.mix
    # Prices the other way round: the other variant.
    other = "h100" if cheaper == "a100" else "a100"
    flipped = [v.model_copy(update={"hourly_price": 1.0 if v.name == other else 100.0}) for v in cheap_a100]
    assert set(run("slo", load_work, variants=flipped)[-1][2].mix) == {other}
    # The cheap one has room for 2 replicas only: the rest of the load goes to the other.
    tight = [v.model_copy(update={"max_replicas": 2}) if v.name == cheaper else v for v in cheap_a100]
    mixed = run("slo", load_work, variants=tight)[-1][2]
    assert mixed.mix[cheaper] == 2 and mixed.mix[other] >= 1 and mixed.desired == sum(mixed.mix.values())


def test_scale_to_zero_and_back() -> None:
    idle = Work(0.0, 0, 0, in_flight=0)
    r = run("slo", series((0, 30, Work(2.0, 500, 100)), (30, 300, idle)), min_replicas=0)
    zero_at = next(t for t, d, _ in r if d == 0)
    delay = H100.cold_start_s + 60  # derived: a cold start and a stable window
    assert 30 + 60 <= zero_at <= 30 + delay + 60 + 4  # the grace; not later than the delay and the grace
    assert "scale to zero" in next(d.reason for t, _, d in r if t == zero_at)
    p, state = make_policy("slo"), ScalerState()
    s = AutoscaleSettings(profile=H100, min_replicas=0, max_replicas=10)
    for t in range(0, 200, 2):
        p.decide(s, state, Observation(at=t, in_flight=0, ready=0, current=0))
    back = p.decide(s, state, Observation(at=200, in_flight=0, queued=1, ready=0, current=0))
    assert back.desired == 1 and "scale from zero" in back.reason


def test_observed_ttft_above_the_model_corrects_it() -> None:
    work = series((0, 300, Work(6.0, 2000, 100)))
    plain = run("slo", work)
    s = AutoscaleSettings(profile=H100, max_replicas=40, target_concurrency=64.0)
    p, state, current = make_policy("slo"), ScalerState(), 1
    for t, w in work:  # replicas three times slower at prefill than the profile says
        pred = ReplicaCapacity(H100).predict(
            Load(w.rps, w.rps * w.prompt, w.rps * w.output), current, 1.0, [w.prompt] * 4
        )
        obs = Observation(
            at=t, in_flight=8, ready=current, current=current, requests_per_s=w.rps,
            prompt_tokens_per_s=w.rps * w.prompt, output_tokens_per_s=w.rps * w.output,
            prompt_sample=(w.prompt,) * 4, ttft_s=3 * pred.ttft_s,
        )  # fmt: skip
        d = p.decide(s, state, obs)
        current = d.desired
    assert d.predicted["correction"] > 1.5 and "from observed TTFT" in d.reason
    assert current > plain[-1][1]


def test_a_backlogs_wait_does_not_correct_the_model() -> None:
    """A start under load (one replica, a backlog of hundreds): the requests answered while
    the backlog drains waited for it, not for slow replicas. Their TTFT is no news about
    the service times, and neither is the first interval after it, whose last queued
    requests still waited: it weighs one tick, not the whole time the backlog lasted."""
    s = AutoscaleSettings(profile=H100, max_replicas=40, target_concurrency=64.0)
    p, state, current = make_policy("slo"), ScalerState(), 1
    w = Work(6.0, 2000, 100)
    d = None
    for t in range(0, 400, 2):
        backlog = max(0.0, 400.0 - 4.0 * t)  # drained by t = 100
        pred = ReplicaCapacity(H100).predict(Load(w.rps, w.rps * w.prompt, w.rps * w.output), current, 1.0,
                                             [w.prompt] * 4)  # fmt: skip
        waited = 60.0 if backlog > 0 or t == 100 else pred.ttft_s  # the service itself as modelled
        obs = Observation(
            at=t, in_flight=8, queued=backlog, ready=current, current=current, requests_per_s=w.rps,
            prompt_tokens_per_s=w.rps * w.prompt, output_tokens_per_s=w.rps * w.output,
            prompt_sample=(w.prompt,) * 4, ttft_s=waited,
        )  # fmt: skip
        d = p.decide(s, state, obs)
        current = d.desired
        if t == 102:
            assert d.predicted["correction"] < 1.1, d.predicted
    assert d is not None and d.predicted["correction"] < 1.05


def test_without_a_profile_it_scales_by_concurrency_and_says_so() -> None:
    p, state = make_policy("ours"), ScalerState()
    s = AutoscaleSettings(target_concurrency=10, target_utilization=0.8, max_replicas=20)
    for t in range(0, 80, 2):
        d = p.decide(s, state, Observation(at=t, in_flight=32, ready=4, current=4))
    assert d.desired == 4 and d.reason.startswith("no performance profile")


@pytest.mark.parametrize("policy", ["slo", "ours", "planner"])
def test_registered_and_bounded(policy: str) -> None:
    r = run(policy, series((0, 400, Work(40.0, 3000, 300))), max_replicas=6)
    assert max(d for _, d, _ in r) == 6


def test_prefix_reuse_shortens_prefill_but_not_the_kv_a_request_holds() -> None:
    cap = ReplicaCapacity(H100)
    cold, warm = Load(6.0, 6000 * 4, 1200), Load(6.0, 6000 * 4, 1200, prefix_reuse=0.75)
    assert Load(6.0, 6000, 1200, 0.0) == Load(6.0, 6000, 1200)  # 0: as before
    a, b = (cap.predict(x, 3, 1.0, [4000] * 4, 2.0) for x in (cold, warm))
    assert b.prefill_s < a.prefill_s and b.prefill_share < a.prefill_share and b.ttft_s < a.ttft_s
    assert b.slot_limit == a.slot_limit  # cached tokens still take KV room
    assert warm.scaled(2).prefix_reuse == 0.75 and warm.mean_prefill == pytest.approx(1000)
    n_cold = smallest(cap, cold, AutoscaleSettings(), 40, 1.0, [4000] * 4)[0]
    assert smallest(cap, warm, AutoscaleSettings(), 40, 1.0, [4000] * 4)[0] < n_cold
    with pytest.raises(ValueError, match="prefix_reuse"):
        Load(1.0, 100, 10, prefix_reuse=1.0)


def test_the_mix_is_spread_quantiles_whatever_order_the_lengths_came_in() -> None:
    from control_plane.autoscale.slo import SAMPLE_MAX, SloMemory

    mem = SloMemory()
    for t in range(16):  # heartbeats bring sorted blocks of lengths
        mem.remember(float(t), tuple(range(100, 1700, 100)))
    mix = mem.mix()
    assert len(mix) == SAMPLE_MAX and min(mix) == 100 and max(mix) == 1600
