"""bf16 as an auto candidate: the candidate set, the pure plan over three formats, the
bf16 kernels and mixed plans that include them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model import weights, weights_choice
from engine.model.weights import Bf16Linear
from engine.model.weights_choice import CANDIDATES_ENV, candidates
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

FP32 = {1: 10.0, 4: 20.0, 16: 30.0, 64: 40.0, 256: 100.0}


@pytest.mark.parametrize(
    ("fp16", "bf16", "plan"),
    [
        # fp16 while memory-bound, fp32 in between, bf16 once compute-bound
        (
            {1: 5.0, 4: 6.0, 16: 20.0, 64: 41.0, 256: 130.0},
            {1: 12.0, 4: 25.0, 16: 33.0, 64: 42.0, 256: 50.0},
            ((16, "fp16"), (64, "fp32"), (None, "bf16")),
        ),
        # bf16 wins from M=16 up: no fp32 bucket is left
        (
            {1: 5.0, 4: 6.0, 16: 20.0, 64: 41.0, 256: 130.0},
            {1: 12.0, 4: 25.0, 16: 18.0, 64: 20.0, 256: 50.0},
            ((4, "fp16"), (None, "bf16")),
        ),
        # emulated bf16 (far slower everywhere): the fp16/fp32 plan of before
        (
            {1: 5.0, 4: 6.0, 16: 20.0, 64: 41.0, 256: 130.0},
            {1: 900.0, 4: 950.0, 16: 990.0, 64: 60.0, 256: 150.0},
            ((16, "fp16"), (None, "fp32")),
        ),
        # bf16 2% faster at the largest M only: not worth a bucket (margin)
        (
            {1: 5.0, 4: 6.0, 16: 20.0, 64: 41.0, 256: 130.0},
            {1: 12.0, 4: 25.0, 16: 33.0, 64: 42.0, 256: 98.0},
            ((16, "fp16"), (None, "fp32")),
        ),
        # fp16 and bf16 tie where both win: the earlier-listed format (fp16) keeps it
        (
            {1: 5.0, 4: 5.0, 16: 5.0, 64: 5.0, 256: 5.0},
            {1: 5.0, 4: 5.0, 16: 5.0, 64: 5.0, 256: 5.0},
            ((None, "fp16"),),
        ),
    ],
)
def test_plan_over_three_formats(fp16, bf16, plan) -> None:
    assert plan_from_timings({"fp32": FP32, "fp16": fp16, "bf16": bf16}) == plan


def test_plan_pick_and_describe_with_three_buckets() -> None:
    plan = ((16, "fp16"), (64, "fp32"), (None, "bf16"))
    assert [pick(plan, m) for m in (1, 16, 17, 64, 65, 4096)] == [
        "fp16",
        "fp16",
        "fp32",
        "fp32",
        "bf16",
        "bf16",
    ]
    assert describe(plan) == "fp16 for M<=16, fp32 for M<=64, bf16 above"


def test_plan_without_fp32_measures_against_the_first_format() -> None:
    assert plan_from_timings({"fp16": {1: 1.0, 64: 4.0}, "bf16": {1: 3.0, 64: 2.0}}) == (
        (1, "fp16"),
        (None, "bf16"),
    )
    assert plan_from_timings({"bf16": {1: 1.0, 64: 1.0}}) == ((None, "bf16"),)


def test_bf16_is_a_candidate_only_when_asked_for() -> None:
    assert candidates("") == ("fp32", "fp16")  # bf16 failed the near-tie gate: opt-in
    assert candidates("bf16, FP32,fp16") == ("fp32", "fp16", "bf16")
    assert candidates("bf16") == ("bf16",)
    with pytest.raises(ValueError, match=f"{CANDIDATES_ENV}: unknown format.*int8"):
        candidates("fp32,int8")


def test_bf16_linear_matches_fp32_within_bf16_precision() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    kernel = Bf16Linear.of(lin)
    assert kernel.path in ("onednn-prepacked", "dense")
    for rows in (1, 7, 65):
        x = torch.randn(2, rows, 96)
        ref = lin(x)
        out = kernel(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_bf16_linear_falls_back_to_dense_where_onednn_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Refusing:
        @staticmethod
        def _reorder_linear_weight(*_args):
            raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(weights.torch.ops, "mkldnn", _Refusing())
    kernel = Bf16Linear(torch.randn(8, 16))
    assert kernel.path == "dense" and kernel.weight.dtype == torch.bfloat16
    assert kernel(torch.randn(3, 16)).shape == (3, 8)


@torch.inference_mode()
def test_a_plan_with_bf16_keeps_fp32_and_fp16_on_the_same_values() -> None:
    torch.manual_seed(2)
    model = TiedLM()
    emb = model.embed_tokens.weight.detach().clone()
    ids = torch.randint(0, 300, (8,))
    ref = model(ids)
    plan = ((1, "fp16"), (4, "fp32"), (None, "bf16"))
    assert apply_linear_plan(model, plan) == 2
    convert_lm_head(model, plan)
    first = model.layers[0][0]
    assert isinstance(first, DispatchLinear) and set(first.kernels) == {"fp32", "fp16", "bf16"}
    w = first.kernels["fp32"].weight
    assert torch.equal(w, w.half().float())  # the fp32 copy holds fp16 values, as beside fp16 alone
    assert torch.equal(model.embed_tokens.weight, emb)  # lookups keep the exact fp32 rows
    fp32_rows = torch.cat([model(ids[i : i + 4]) for i in range(0, 8, 4)])  # 4 rows: fp32 kernels
    fp16_rows = torch.cat([model(ids[i : i + 1]) for i in range(8)])  # 1 row: fp16 kernels
    assert torch.allclose(fp32_rows, fp16_rows, rtol=1e-4, atol=1e-4)  # same weights, other kernel
    bf16_rows = model(ids)  # 8 rows: bf16 kernels (activations rounded too)
    for out in (fp32_rows, bf16_rows):
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2


@torch.inference_mode()
def test_a_bf16_only_plan_drops_the_fp32_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CANDIDATES_ENV, "bf16")
    monkeypatch.setattr(
        weights_choice, "time_kernels", lambda *a, **k: pytest.fail("one candidate: nothing to time")
    )
    model = TiedLM()
    choice = weights_choice.apply_auto(model)
    assert choice.summary() == "linears bf16; LM head bf16"
    assert isinstance(model.layers[0][0], Bf16Linear) and isinstance(model.logits_head, Bf16Linear)
    assert model(torch.tensor([1, 2, 3])).shape == (3, 300)


def test_the_candidate_set_is_part_of_the_measurement_key(
    auto_timer: AutoTimer, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    # bf16 wins large M, fp16 small
    auto_timer.result = {"fp32": {1: 2.0, 64: 2.0}, "fp16": {1: 1.0, 64: 3.0}, "bf16": {1: 4.0, 64: 1.0}}
    assert weights_choice.apply_auto(TiedLM()).linears == ((1, "fp16"), (None, "fp32"))
    monkeypatch.setenv(CANDIDATES_ENV, "fp32,fp16,bf16")
    choice = weights_choice.apply_auto(TiedLM())  # a new set is measured, not read from the cache
    formats_timed = auto_timer.calls[-1][0]
    assert choice.linears == ((1, "fp16"), (None, "bf16")) and formats_timed == ("fp32", "fp16", "bf16")
    assert len(list((tmp_path / "plans").glob("*.json"))) == 2
