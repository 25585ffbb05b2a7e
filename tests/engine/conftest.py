"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from engine.model import weights_choice
from tests.engine.auto_timer import AutoTimer


@pytest.fixture
def auto_timer(monkeypatch: pytest.MonkeyPatch, tmp_path) -> AutoTimer:
    """`--weights auto` over fp32 and fp16 at M in (1, 64), its plan cache under tmp_path/plans,
    nothing measured yet in this process, and fake timings (fp16 wins M=1, fp32 M=64)."""
    monkeypatch.setenv("FLEET_WEIGHTS_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setenv(weights_choice.CANDIDATES_ENV, "fp32,fp16")
    monkeypatch.setattr(weights_choice, "_MEASURED", {})
    monkeypatch.setattr(weights_choice, "LINEAR_SIZES", (1, 64))
    monkeypatch.setattr(weights_choice, "HEAD_SIZES", (1, 64))
    timer = AutoTimer()
    monkeypatch.setattr(weights_choice, "time_kernels", timer)
    return timer
