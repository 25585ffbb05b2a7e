"""The prefill-queue benchmark runs on tiny sizes, and both of its sides answer the same waits
(it exits otherwise)."""

from __future__ import annotations

import pytest

from bench import prefill_queue


def test_the_bench_prints_both_sides_at_each_length(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per row
    prefill_queue.main(["--lengths", "1,50", "--rounds", "40"])
    out = capsys.readouterr().out
    assert "kept end (ours)" in out and "fold (baseline)" in out
    assert out.count("no cap") == 2 and "50" in out


def test_both_sides_agree_under_a_long_prefill_cap() -> None:
    timing = prefill_queue.long_prefill_timing(prefill_queue.TIMING, 2048, 8192)
    ours, base = prefill_queue.measure(200, 50, timing)
    assert ours > 0 and base > 0
