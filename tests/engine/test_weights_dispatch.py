"""Per-batch-size weight dispatch: the pure plan from timings, the fp16 kernels, auto's choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model import weights_choice
from engine.model.weights import Fp16Linear
from engine.model.weights_dispatch import (
    DispatchLinear,
    apply_linear_plan,
    convert_lm_head,
    describe,
    pick,
    plan_from_timings,
)
from tests.engine.auto_timer import AutoTimer
from tests.engine.tied_lm import TiedLM


def test_plan_puts_one_crossover_where_the_small_batch_format_stops_winning() -> None:
    timings = {
        "fp32": {1: 10.0, 4: 20.0, 16: 30.0, 64: 40.0, 256: 100.0},
        "fp16": {1: 5.0, 4: 6.0, 16: 20.0, 64: 41.0, 256: 130.0},
    }
    plan = plan_from_timings(timings)
    assert plan == ((16, "fp16"), (None, "fp32"))
    assert [pick(plan, m) for m in (1, 16, 17, 64, 5000)] == ["fp16", "fp16", "fp32", "fp32", "fp32"]
    assert describe(plan) == "fp16 for M<=16, fp32 above"


def test_a_single_noisy_size_does_not_get_a_bucket_of_its_own() -> None:
    noisy = {"fp32": {1: 2.0, 4: 2.0, 16: 8.0, 64: 9.0}, "fp16": {1: 1.0, 4: 2.2, 16: 4.0, 64: 12.0}}
    assert plan_from_timings(noisy) == ((16, "fp16"), (None, "fp32"))


def test_plan_with_one_winner_is_one_bucket_and_a_small_gain_keeps_fp32() -> None:
    assert plan_from_timings({"fp32": {1: 2.0, 8: 2.0}, "fp16": {1: 1.0, 8: 1.0}}) == ((None, "fp16"),)
    assert plan_from_timings({"fp32": {1: 1.0, 8: 1.0}, "fp16": {1: 0.98, 8: 0.99}}) == ((None, "fp32"),)
    assert plan_from_timings({"fp32": {1: 1.0, 8: 1.0}, "fp16": {1: 1.5, 8: 2.0}}) == ((None, "fp32"),)
    assert describe(((None, "fp32"),)) == "fp32"


def test_fp16_linear_matches_fp32_within_half_precision() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    for rows in (1, 7, 33):
        x = torch.randn(2, rows, 96)
        ref = lin(x)
        out = Fp16Linear.of(lin)(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert ((out - ref).norm() / ref.norm()).item() < 2e-3


@torch.inference_mode()
def test_a_mixed_plan_gives_the_same_values_whichever_kernel_a_batch_runs() -> None:
    torch.manual_seed(1)
    model = TiedLM()
    emb = model.embed_tokens.weight.detach().clone()
    ids = torch.randint(0, 300, (6,))
    ref = model(ids)
    plan = ((2, "fp16"), (None, "fp32"))
    assert apply_linear_plan(model, plan) == 2
    convert_lm_head(model, plan)
    assert isinstance(model.layers[0][0], DispatchLinear) and isinstance(model.logits_head, DispatchLinear)
    assert torch.equal(model.embed_tokens.weight, emb)  # lookups keep the exact fp32 rows
    big = model(ids)  # 6 rows: the (fp16-rounded) fp32 kernels
    small = torch.cat([model(ids[i : i + 2]) for i in range(0, 6, 2)])  # 2 rows: fp16 kernels
    assert torch.allclose(big, small, rtol=1e-5, atol=1e-5)
    assert ((big - ref).norm() / ref.norm()).item() < 2e-3


def test_single_format_plans_keep_one_copy() -> None:
    model = TiedLM()
    apply_linear_plan(model, ((None, "fp16"),))
    assert isinstance(model.layers[0][0], Fp16Linear)
    convert_lm_head(model, ((None, "fp32"),))
    assert model.logits_head is None
    model = TiedLM()
    assert apply_linear_plan(model, ((None, "fp32"),)) == 0
    assert isinstance(model.layers[0][0], nn.Linear)


def test_auto_measures_once_then_applies_its_plan(auto_timer: AutoTimer) -> None:
    calls = auto_timer.calls  # fp16 wins small batches, fp32 large ones
    model = TiedLM()
    choice = weights_choice.apply_auto(model)
    assert choice.summary() == "linears fp16 for M<=1, fp32 above; LM head fp16 for M<=1, fp32 above"
    assert isinstance(model.layers[0][1], DispatchLinear) and model.layers[0][1].plan == choice.linears
    measured = len(calls)
    assert measured >= 2  # linears and LM head, at each thread count the tuner may pick
    weights_choice.apply_auto(TiedLM())
    assert len(calls) == measured  # the second model of the same shape reuses the measurement


def test_auto_packs_the_fp16_head_once_and_only_if_its_plan_uses_it(
    auto_timer: AutoTimer, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    head_packs = []
    real_fp16 = weights_choice.Fp16Linear

    def counting_fp16(weight):
        packed = real_fp16(weight)
        if weight.shape[0] == TiedLM().embed_tokens.weight.shape[0]:  # the vocabulary: the head
            head_packs.append(packed)
        return packed

    monkeypatch.setattr(weights_choice, "Fp16Linear", counting_fp16)
    auto_timer.result = {"fp32": {1: 2.0, 64: 2.0}, "fp16": {1: 1.0, 64: 1.0}}  # fp16 wins everywhere
    model = TiedLM()
    assert weights_choice.apply_auto(model).lm_head == ((None, "fp16"),)
    assert len(head_packs) == 1 and model.logits_head is head_packs[0]  # timed, then installed as it is

    monkeypatch.setattr(weights_choice, "_MEASURED", {})
    auto_timer.result = {"fp32": {1: 1.0, 64: 1.0}, "fp16": {1: 2.0, 64: 2.0}}  # fp32 wins everywhere
    monkeypatch.setenv("FLEET_WEIGHTS_PLAN_CACHE", str(tmp_path / "other-plans"))
    weights_choice.apply_auto(TiedLM())  # measured (packs one for timing) and remembered on disk
    head_packs.clear()
    monkeypatch.setattr(weights_choice, "_MEASURED", {})  # a new process
    model = TiedLM()
    assert weights_choice.apply_auto(model).lm_head == ((None, "fp32"),)
    assert head_packs == [] and model.logits_head is None  # the remembered fp32 plan packs nothing


def test_auto_plan_is_kept_on_disk_for_the_next_process(
    auto_timer: AutoTimer, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    root, calls = tmp_path / "plans", auto_timer.calls
    first = weights_choice.apply_auto(TiedLM())
    assert calls and len(list(root.glob("*.json"))) == 1
    measured = len(calls)
    monkeypatch.setattr(weights_choice, "_MEASURED", {})  # a new process: only the disk remains
    again = weights_choice.apply_auto(TiedLM())
    assert len(calls) == measured and again.linears == first.linears and again.lm_head == first.lm_head
    for path in root.glob("*.json"):  # a torn file is measured again, not trusted
        path.write_text("{not json")
    monkeypatch.setattr(weights_choice, "_MEASURED", {})
    weights_choice.apply_auto(TiedLM())
    assert len(calls) > measured
    monkeypatch.setenv("FLEET_WEIGHTS_PLAN_CACHE", "off")
    monkeypatch.setattr(weights_choice, "_MEASURED", {})
    before = len(calls)
    weights_choice.apply_auto(TiedLM())
    assert len(calls) > before


@torch.inference_mode()
def test_dispatch_follows_the_row_count_from_call_to_call() -> None:
    """The kernel chosen for the last row count is reused only while M stays the same."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32, bias=False)
    layer = DispatchLinear({"fp32": linear, "fp16": Fp16Linear.of(linear)}, ((2, "fp16"), (None, "fp32")))
    calls: list[str] = []
    for name, kernel in layer.kernels.items():
        original = kernel.forward
        kernel.forward = lambda x, n=name, f=original: (calls.append(n), f(x))[1]
    for m in (1, 1, 5, 5, 2, 8):
        layer(torch.randn(m, 64))
    assert calls == ["fp16", "fp16", "fp32", "fp32", "fp16", "fp32"]


@torch.inference_mode()
def test_fp16_linear_rows_fast_path_equals_the_general_path() -> None:
    torch.manual_seed(3)
    fp16 = Fp16Linear(torch.randn(48, 64))
    x = torch.randn(2, 3, 64)
    flat = fp16(x.reshape(6, 64))  # contiguous 2-D float32: straight to the kernel
    assert torch.equal(fp16(x), flat.reshape(2, 3, 48))
    assert torch.equal(fp16(x.reshape(6, 64).t().contiguous().t()), flat)  # non-contiguous rows
