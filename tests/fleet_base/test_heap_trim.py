"""The heap trimmer: a fragmented heap's free pages go back to the kernel, measured as RSS
in a fresh process; its interval setting refuses nonsense."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet_base import heap_trim

FRAGMENT_THEN_TRIM = r"""
import os
from fleet_base import heap_trim

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

blocks = [bytearray(4000) for _ in range(40_000)]  # ~160 MiB of malloc'd chunks
kept = blocks[15::16]                              # every 16th stays: holes, not a free top
del blocks
before = rss_mib()
released = heap_trim.trim()
print(before, rss_mib(), released, len(kept))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap_trim.trim() is None, reason="glibc only")
def test_a_fragmented_heap_gives_its_free_pages_back():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT_THEN_TRIM], capture_output=True, text=True, check=True
    )
    before, after, released, _ = out.stdout.split()
    print(f"\nRSS {float(before):.1f} MiB -> {float(after):.1f} MiB after malloc_trim")
    assert released == "True"
    assert float(before) - float(after) > 80  # of the ~150 MiB freed between kept blocks


@pytest.mark.parametrize(
    ("raw", "want"), [("", heap_trim.DEFAULT_INTERVAL_S), ("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)]
)
def test_interval_from_env(raw: str, want: float):
    assert heap_trim.interval_from_env({heap_trim.ENV: raw}) == want


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_interval_from_env_refuses_nonsense(raw: str):
    with pytest.raises(ValueError, match=heap_trim.ENV):
        heap_trim.interval_from_env({heap_trim.ENV: raw})


def test_start_is_once_per_process_and_off_at_zero(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(heap_trim, "_started", None)
    assert heap_trim.start(0) is None
    first = heap_trim.start(3600)
    try:
        assert first is not None and heap_trim.start(3600) is first
    finally:
        if first is not None:
            first.set()
