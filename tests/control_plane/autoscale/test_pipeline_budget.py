"""The end-to-end budget split over a pipeline's steps (`control_plane.autoscale.pipeline_budget`):
table tests, Scale(now) style."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_plane.autoscale.pipeline_budget import (
    FLOOR_MARGIN,
    MIN_ITL,
    MIN_SHARE,
    MIN_TARGET,
    BudgetMemory,
    StepFloor,
    StepLatency,
    split,
    step_floor,
    step_latency,
)
from control_plane.autoscale.policy import AutoscaleSettings, Observation, ScalerState
from control_plane.autoscale.slo import SloMemory, least_latency
from fleet_base.pipelines import PipelineSpec, PipelineStep
from fleet_base.profile import load_profile

RAG = PipelineSpec(
    name="rag",
    steps=(PipelineStep(name="embed", deployment="emb"), PipelineStep(name="answer", deployment="chat")),
    slo_e2e_s=1.0,
)
OWN = {"emb": 2.0, "chat": 2.0}


def lat(total: float | None, ttft: float | None = None) -> StepLatency:
    return StepLatency(total, total if ttft is None else ttft)


@pytest.mark.parametrize(
    ("name", "latency", "over", "targets"),
    [
        # 0.9 + 0.3 = 1.2 s against 1 s, no floors known: shares from measured, both over by
        # the same ratio, so neither alone meets the budget: both tightened
        ("both over, slow first", {"emb": lat(0.3), "chat": lat(0.9)}, {"emb": True, "chat": True},
         {"emb": 0.25, "chat": 0.75}),
        # within the budget: nobody's target changes because of the pipeline
        ("within budget", {"emb": lat(0.1), "chat": lat(0.5)}, {"emb": False, "chat": False},
         {"emb": 2.0, "chat": 2.0}),
        # a 5 ms step keeps the floor's share (1/8 of 1 s) and is left alone; chat over
        ("fast step left", {"emb": lat(0.005), "chat": lat(1.2)}, {"emb": False, "chat": True},
         {"emb": 2.0, "chat": 0.875}),
        # decode alone exceeds chat's share: its TTFT target at the floor, not zero or negative;
        # embed's 100 ms is within its floored share (125 ms)
        ("decode-bound", {"emb": lat(0.1), "chat": lat(2.0, ttft=0.1)}, {"emb": False, "chat": True},
         {"emb": 2.0, "chat": MIN_TARGET * 0.875}),
        # nothing measured yet: even shares, no step over
        ("not measured", {}, {"emb": False, "chat": False}, {"emb": 2.0, "chat": 2.0}),
    ],
)  # fmt: skip
def test_first_decision(name, latency, over, targets) -> None:
    out = split([RAG], latency, OWN, BudgetMemory(), now=0.0)
    assert {d: b.over for d, b in out.items()} == over, name
    for d, want in targets.items():
        assert out[d].target_ttft_s == pytest.approx(want, rel=1e-6), (name, d)
    assert all(b.target_ttft_s <= OWN[d] for d, b in out.items())


def test_slow_step_scales_first() -> None:
    """Shares settle on 0.2 / 0.8; then chat slows: chat is over its share, embed is not
    (its smoothed share still holds), so only chat's target is tightened."""
    mem = BudgetMemory()
    for t in range(0, 600, 2):
        out = split([RAG], {"emb": lat(0.16), "chat": lat(0.64)}, OWN, mem, float(t))
    assert not any(b.over for b in out.values())
    assert out["chat"].share == pytest.approx(0.8, abs=1e-3)
    out = split([RAG], {"emb": lat(0.16), "chat": lat(1.2)}, OWN, mem, 600.0)
    assert out["chat"].over and out["chat"].priority == 1
    assert out["chat"].target_ttft_s < OWN["chat"]
    assert not out["emb"].over and out["emb"].target_ttft_s == OWN["emb"] and out["emb"].priority == 0
    assert "rag" in out["chat"].reason and "budget" in out["chat"].reason


def test_shares_are_smoothed() -> None:
    """A step's share moves towards its new proportion over SHARE_S, not in one tick."""
    mem = BudgetMemory()
    split([RAG], {"emb": lat(0.5), "chat": lat(0.5)}, OWN, mem, 0.0)
    one = split([RAG], {"emb": lat(0.2), "chat": lat(0.8)}, OWN, mem, 2.0)
    assert 0.5 < one["chat"].share < 0.6
    later = one
    for t in range(4, 400, 2):
        later = split([RAG], {"emb": lat(0.2), "chat": lat(0.8)}, OWN, mem, float(t))
    assert later["chat"].share == pytest.approx(0.8, abs=1e-3)


def test_unmeasured_step_keeps_its_share() -> None:
    mem = BudgetMemory()
    split([RAG], {"emb": lat(0.2), "chat": lat(0.6)}, OWN, mem, 0.0)
    out = split([RAG], {"chat": lat(0.6)}, OWN, mem, 2.0)
    assert out["emb"].share == pytest.approx(0.25) and out["chat"].share == pytest.approx(0.75)
    assert not out["emb"].over


def test_decode_bound_step_gets_a_tighter_itl() -> None:
    """Decode alone takes chat over its share: its ITL target too, in proportion to the
    decode time its share leaves, never below MIN_ITL of its own; within: ITL untouched."""
    own_itl = {"emb": 0.1, "chat": 0.1}
    slow = {"emb": StepLatency(0.01, 0.01), "chat": StepLatency(1.1, 0.2, itl_s=0.06)}
    out = split([RAG], slow, OWN, BudgetMemory(), 0.0, own_itl)
    chat = out["chat"]
    assert chat.over and chat.target_itl_s == pytest.approx(0.06 * 0.9 * 0.875 / 0.9)
    assert chat.settings_update() == {"slo_ttft_s": chat.target_ttft_s, "slo_itl_s": chat.target_itl_s}
    assert "ITL target" in chat.reason
    assert out["emb"].target_itl_s is None and out["emb"].settings_update() == {}
    hopeless = {"emb": StepLatency(0.01, 0.01), "chat": StepLatency(20.0, 0.2, itl_s=0.06)}
    assert split([RAG], hopeless, OWN, BudgetMemory(), 0.0, own_itl)["chat"].target_itl_s == pytest.approx(
        MIN_ITL * 0.1
    )
    # a budget the decode fits in: TTFT alone is tightened
    fits = {"emb": StepLatency(0.01, 0.01), "chat": StepLatency(1.2, 0.7, itl_s=0.005)}
    assert split([RAG], fits, OWN, BudgetMemory(), 0.0, own_itl)["chat"].target_itl_s is None


def test_no_budget_unchanged() -> None:
    spec = RAG.model_copy(update={"slo_e2e_s": None})
    assert split([spec], {"emb": lat(5.0), "chat": lat(5.0)}, OWN, BudgetMemory(), 0.0) == {}


def test_tightest_of_several_pipelines() -> None:
    other = PipelineSpec(name="ask", steps=(PipelineStep(name="answer", deployment="chat"),), slo_e2e_s=0.5)
    out = split([RAG, other], {"emb": lat(0.1), "chat": lat(0.9)}, OWN, BudgetMemory(), 0.0)
    assert out["chat"].pipeline == "ask" and out["chat"].target_ttft_s == pytest.approx(0.5)


def test_step_latency_from_observation() -> None:
    obs = Observation(0.0, 1, requests_per_s=2.0, output_tokens_per_s=202.0, ttft_s=0.2, itl_s=0.01)
    assert step_latency(obs).total_s == pytest.approx(0.2 + 100 * 0.01)
    assert step_latency(Observation(0.0, 1)).total_s is None


@given(
    st.lists(st.one_of(st.none(), st.floats(1e-4, 100)), min_size=2, max_size=2),
    st.floats(0.05, 10),
)
def test_shares_floor_and_sum(measured, budget) -> None:
    spec = RAG.model_copy(update={"slo_e2e_s": budget})
    out = split([spec], {"emb": lat(measured[0]), "chat": lat(measured[1])}, OWN, BudgetMemory(), 0.0)
    assert sum(b.share for b in out.values()) == pytest.approx(1.0)
    assert all(b.share >= MIN_SHARE / 2 - 1e-9 for b in out.values())
    assert all(0 < b.target_ttft_s <= OWN[d] for d, b in out.items())


OWN_ITL = {"emb": 0.1, "chat": 0.1}
DECODE_BOUND = {
    "emb": StepLatency(0.01, 0.01),
    "chat": StepLatency(1.1, 0.2, itl_s=0.06),
}  # wants ITL 52.5 ms


@pytest.mark.parametrize(
    ("name", "latency", "floor", "unreachable", "update"),
    [
        # chat's share is 750 ms; one replica on an empty queue does 100 ms: tightened as before
        ("TTFT reachable", {"emb": lat(0.3), "chat": lat(0.9)}, StepFloor(ttft_s=0.1), False,
         {"slo_ttft_s": 0.75}),
        # 700 ms on an empty queue (x1.25 = 875 ms > 750 ms): no count buys the share
        ("TTFT below its floor", {"emb": lat(0.3), "chat": lat(0.9)}, StepFloor(ttft_s=0.7), True, {}),
        # decode-bound: ITL 52.5 ms wanted, 45 ms at batch 1 (x1.25 = 56 ms): out of reach
        ("ITL below its floor", DECODE_BOUND, StepFloor(itl_s=0.045), True, {}),
        # 30 ms at batch 1 (x1.25 = 37.5 ms): 52.5 ms is bought by replicas, tightened as before
        ("ITL reachable", DECODE_BOUND, StepFloor(itl_s=0.03), False,
         {"slo_ttft_s": MIN_TARGET * 0.875, "slo_itl_s": 0.0525}),
        # the floor not known (no profile): as before
        ("floor unknown", DECODE_BOUND, StepFloor(), False,
         {"slo_ttft_s": MIN_TARGET * 0.875, "slo_itl_s": 0.0525}),
    ],
)  # fmt: skip
def test_target_floored_at_least_load(name, latency, floor, unreachable, update) -> None:
    """A tightened target within FLOOR_MARGIN of what the step reaches with the least load is
    one no replica count buys: the step keeps its own targets, says so, and is not ranked."""
    # embed needs a third of chat at least load: the shares stay 1/4 and 3/4
    emb = StepFloor(ttft_s=floor.ttft_s / 3) if floor.ttft_s is not None else StepFloor()
    out = split([RAG], latency, OWN, BudgetMemory(), 0.0, OWN_ITL, {"chat": floor, "emb": emb})
    chat = out["chat"]
    assert chat.over and chat.unreachable is unreachable, name
    assert chat.settings_update() == pytest.approx(update), name
    assert ("over budget: unreachable by scaling" in chat.reason) is unreachable, name
    if unreachable:
        assert chat.priority == 0 and chat.target_ttft_s == OWN["chat"] and chat.target_itl_s is None
        assert chat.as_dict()["unreachable"] is True
    else:
        assert chat.priority >= 1
        assert split([RAG], latency, OWN, BudgetMemory(), 0.0, OWN_ITL)[
            "chat"
        ].settings_update() == pytest.approx(update)


@given(
    st.floats(0.05, 5),
    st.floats(1e-3, 2),
    st.floats(1e-3, 0.2),
    st.floats(0.01, 10),
    st.floats(1e-3, 0.2),
)
def test_no_target_below_what_replicas_buy(budget, ttft_floor, itl_floor, chat_s, chat_itl) -> None:
    spec = RAG.model_copy(update={"slo_e2e_s": budget})
    latency = {"emb": lat(0.01), "chat": StepLatency(chat_s, 0.1 * chat_s, itl_s=chat_itl)}
    floor = StepFloor(ttft_floor, itl_floor)
    chat = split([spec], latency, OWN, BudgetMemory(), 0.0, OWN_ITL, {"chat": floor})["chat"]
    update = chat.settings_update()
    assert update.get("slo_ttft_s", OWN["chat"]) >= min(OWN["chat"], ttft_floor * (1 + FLOOR_MARGIN))
    assert update.get("slo_itl_s", OWN_ITL["chat"]) >= min(OWN_ITL["chat"], itl_floor * (1 + FLOOR_MARGIN))


def test_least_latency_from_the_profile_and_correction() -> None:
    """Empty queue, mean prompt, batch 1, at the SLO policy's correction; no profile: unknown."""
    profile = load_profile("llama2-70b-h100-tp4")
    settings = AutoscaleSettings(profile=profile)
    obs = Observation(0.0, 1, requests_per_s=2.0, prompt_tokens_per_s=4096.0)
    assert least_latency(settings, None, obs) == pytest.approx(
        (profile.prefill_time(2048), profile.decode_time(1))
    )
    state = ScalerState()
    state.memory["slo"] = SloMemory(correction=2.0)
    assert step_floor(settings, state, obs) == StepFloor(
        pytest.approx(2 * profile.prefill_time(2048)), pytest.approx(2 * profile.decode_time(1))
    )
    assert step_floor(settings, None, Observation(0.0, 1)).ttft_s is None
    assert step_floor(AutoscaleSettings(), None, obs) == StepFloor()


RAG3 = PipelineSpec(
    name="rag3",
    steps=(
        PipelineStep(name="embed", deployment="emb"),
        PipelineStep(name="rerank", deployment="rr"),
        PipelineStep(name="answer", deployment="chat"),
    ),
    slo_e2e_s=1.0,
)
OWN3 = {"emb": 2.0, "rr": 2.0, "chat": 2.0}


def test_shares_follow_what_each_step_needs_at_least() -> None:
    """Floors 100 / 400 ms: shares 0.2 / 0.8 whatever the load. In steady overload (300 +
    900 ms) both steps are over; embed is 1.5x its share, answer 1.125x: embed (not the
    alphabetically first step) has priority 1. Every step is over its share, so no step's
    slack absorbs another's excess: both are tightened, each to its share."""
    floors = {"emb": StepFloor(ttft_s=0.1), "chat": StepFloor(ttft_s=0.4)}
    mem = BudgetMemory()
    for t in range(0, 600, 2):
        out = split([RAG], {"emb": lat(0.3), "chat": lat(0.9)}, OWN, mem, float(t), None, floors)
    emb, chat = out["emb"], out["chat"]
    assert emb.share == pytest.approx(0.2) and chat.share == pytest.approx(0.8)
    assert emb.need_s == pytest.approx(0.1) and chat.need_s == pytest.approx(0.4)
    assert (emb.priority, chat.priority) == (1, 2)
    assert emb.settings_update() == pytest.approx({"slo_ttft_s": 0.2})
    assert chat.settings_update() == pytest.approx({"slo_ttft_s": 0.8})


def test_only_the_furthest_over_is_tightened_when_that_meets_the_budget() -> None:
    """Floors 100 / 100 / 300 ms: shares 0.2 / 0.2 / 0.6. Measured 400 + 100 + 650 ms = 1.15 s:
    embed is 2x its share, answer 1.08x, rerank within (100 ms of slack). Embed at its share
    makes 950 ms: only embed is tightened; answer is over its share, ranked 2, and keeps its
    own target (rerank's slack absorbs its excess)."""
    floors = {"emb": StepFloor(ttft_s=0.1), "rr": StepFloor(ttft_s=0.1), "chat": StepFloor(ttft_s=0.3)}
    mem = BudgetMemory()
    latency = {"emb": lat(0.4), "rr": lat(0.1), "chat": lat(0.65)}
    for t in range(0, 600, 2):
        out = split([RAG3], latency, OWN3, mem, float(t), None, floors)
    assert [out[d].share for d in ("emb", "rr", "chat")] == pytest.approx([0.2, 0.2, 0.6])
    assert (out["emb"].priority, out["chat"].priority, out["rr"].priority) == (1, 2, 0)
    assert out["emb"].settings_update() == pytest.approx({"slo_ttft_s": 0.2})
    assert out["chat"].over and out["chat"].settings_update() == {} and out["chat"].target_ttft_s == 2.0
    assert "its own targets kept" in out["chat"].reason and out["chat"].as_dict()["tightened"] is False
    assert not out["rr"].over and out["rr"].settings_update() == {}
    # 200 ms more in answer: rerank's slack no longer absorbs it, answer is tightened too
    latency["chat"] = lat(0.85)
    out = split([RAG3], latency, OWN3, mem, 600.0, None, floors)
    assert out["emb"].priority == 1 and out["chat"].settings_update() == pytest.approx({"slo_ttft_s": 0.6})


def test_over_its_share_within_the_budget_is_not_tightened() -> None:
    floors = {"emb": StepFloor(ttft_s=0.1), "chat": StepFloor(ttft_s=0.4)}
    out = split([RAG], {"emb": lat(0.3), "chat": lat(0.5)}, OWN, BudgetMemory(), 0.0, None, floors)
    assert out["emb"].over and out["emb"].priority == 1 and out["emb"].settings_update() == {}
    assert not out["chat"].over


def test_floor_latency_counts_the_decode_at_batch_one() -> None:
    """20 output tokens after the first at 10 ms measured: the floor is TTFT floor + 20 x ITL floor."""
    measured = StepLatency(0.5, 0.3, itl_s=0.01)
    assert StepFloor(0.05, 0.002).latency(measured) == pytest.approx(0.05 + 20 * 0.002)
    assert StepFloor(None, 0.002).latency(measured) is None


def test_memory_forgets_pipelines_gone_and_recreated() -> None:
    mem = BudgetMemory()
    for t in range(0, 400, 2):
        split([RAG], {"emb": lat(0.2), "chat": lat(0.8)}, OWN, mem, float(t))
    split([], {}, OWN, mem, 400.0)
    assert mem.shares == {} and mem.at == {} and mem.steps == {}
    for t in range(0, 400, 2):
        split([RAG], {"emb": lat(0.2), "chat": lat(0.8)}, OWN, mem, float(t))
    # recreated under the same name with other steps: fresh shares, not the old ones smoothed
    other = RAG.model_copy(update={"steps": (PipelineStep(name="embed", deployment="emb2"), RAG.steps[1])})
    out = split([other], {"emb2": lat(0.5), "chat": lat(0.5)}, {**OWN, "emb2": 2.0}, mem, 402.0)
    assert out["emb2"].share == pytest.approx(0.5) and out["chat"].share == pytest.approx(0.5)
    # a pipeline without a budget is forgotten too
    split([other.model_copy(update={"slo_e2e_s": None})], {}, OWN, mem, 404.0)
    assert mem.shares == {}


@given(
    st.lists(st.floats(1e-3, 2), min_size=3, max_size=3),
    st.lists(st.one_of(st.none(), st.floats(1e-3, 1)), min_size=3, max_size=3),
    st.floats(0.1, 5),
)
def test_ranked_by_how_far_over_its_share_tightened_until_the_budget_is_met(measured, floor, budget) -> None:
    spec = RAG3.model_copy(update={"slo_e2e_s": budget})
    deps = ("emb", "rr", "chat")
    latency = {d: lat(m) for d, m in zip(deps, measured, strict=True)}
    floors = {d: StepFloor(ttft_s=f) for d, f in zip(deps, floor, strict=True)}
    out = split([spec], latency, OWN3, BudgetMemory(), 0.0, None, floors)
    assert sum(b.share for b in out.values()) == pytest.approx(1.0)
    ranked = sorted((b for b in out.values() if b.priority), key=lambda b: b.priority)
    assert all(b.over and not b.unreachable for b in ranked)
    ratios = [b.measured_s / b.budget_s for b in ranked]
    assert ratios == sorted(ratios, reverse=True)
    tight = [b for b in out.values() if b.settings_update()]
    if sum(measured) <= budget:
        assert not tight
    else:
        # tightened: a prefix of the ranking, and the pipeline meets its budget with them at
        # their shares, or every reachable step over its share is tightened
        assert all(b.priority <= min((x.priority for x in ranked if not x.settings_update()), default=99)
                   for b in tight)  # fmt: skip
        at = sum(b.budget_s if b.settings_update() else b.measured_s for b in out.values())
        assert at <= budget * (1 + 1e-9) or len(tight) == len(ranked)
    # the names never decide: the same steps renamed rank the same
    renamed = spec.model_copy(
        update={
            "steps": tuple(
                PipelineStep(name=f"z{9 - i}", deployment=s.deployment) for i, s in enumerate(spec.steps)
            )
        }
    )
    again = split([renamed], latency, OWN3, BudgetMemory(), 0.0, None, floors)
    assert {d: b.priority for d, b in again.items()} == {d: b.priority for d, b in out.items()}
