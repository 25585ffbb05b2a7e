"""bench.tracing_overhead's figures: ratios to the "off" pair, percentiles, from recorded batches."""

from __future__ import annotations

import argparse

from bench.tracing_overhead import Pair, pct, report_rows


def pair(mode: str, latencies: list[float], seconds: float) -> Pair:
    return Pair(mode, gateway=None, sim=None, latencies=latencies, seconds=seconds, requests=len(latencies))  # type: ignore[arg-type]


def test_ratios_are_to_the_off_pair() -> None:
    args = argparse.Namespace(rounds=1, requests=4, concurrency=2, max_tokens=8)
    report = report_rows([pair("off", [0.1] * 4, 1.0), pair("on", [0.2] * 4, 2.0)], 28, args)
    assert report["figures"]["off"]["requests_per_s"] == 4.0
    assert report["ratio_to_off"]["on"] == {"requests_per_s": 0.5, "p50_ms": 2.0, "p99_ms": 2.0}
    assert report["spans_exported"] == 28


def test_percentiles() -> None:
    values = [float(i) for i in range(1, 101)]
    assert (pct(values, 0.5), pct(values, 0.99), pct([], 0.5)) == (51.0, 100.0, None)
