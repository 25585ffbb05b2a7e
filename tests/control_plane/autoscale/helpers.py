"""Demand series for the autoscaler tests."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def series(*parts: tuple[float, float, T], step: float = 2.0) -> list[tuple[float, T]]:
    """(from_s, to_s, value) segments sampled every `step` seconds."""
    out = []
    for a, b, value in parts:
        t = a
        while t < b:
            out.append((t, value))
            t += step
    return out
