"""The heap trimmer: a fragmented heap's free pages go back to the kernel, measured as RSS
in a fresh process; its interval setting refuses nonsense. The tuning: after one large
buffer is freed, later large buffers are still mmapped (glibc alone carves them from the
heap), and glibc's own settings win."""

from __future__ import annotations

import os
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
    assert heap_trim.start(0, tune_allocator=False) is None
    first = heap_trim.start(3600, tune_allocator=False)  # this process's allocator stays as it is
    try:
        assert first is not None and heap_trim.start(3600, tune_allocator=False) is first
    finally:
        if first is not None:
            first.set()


BIG_AFTER_BIGGER = r"""
import ctypes, sys
from fleet_base import heap_trim

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

applied = heap_trim.tune() if sys.argv[1] == "tuned" else {}
first = bytearray(8 << 20)  # mmapped; freeing it moves glibc's own threshold up to 8 MiB
del first
bodies = [bytearray(1 << 20) for _ in range(16)]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
print(sorted(applied), libc.mallinfo2().hblks)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap_trim.trim() is None, reason="glibc only")
def test_tuned_big_buffers_stay_mmapped_after_a_bigger_one():
    def run(side: str) -> tuple[str, int]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "FLEET_MALLOC"))
        }
        out = subprocess.run(
            [sys.executable, "-c", BIG_AFTER_BIGGER, side],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.strip()
        applied, blocks = out.rsplit(" ", 1)
        return applied, int(blocks)

    untuned, tuned = run("glibc"), run("tuned")
    assert tuned[0] == "['arena_max', 'mmap_threshold']"
    assert tuned[1] >= 16  # each 1 MiB body mapped: freed whole
    assert untuned[1] < 16  # glibc alone put them in the heap, between whatever lives there


@pytest.mark.parametrize(
    ("environ", "left"),
    [
        ({}, {"arena_max", "mmap_threshold"}),
        ({"MALLOC_ARENA_MAX": "4"}, {"mmap_threshold"}),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, {"arena_max"}),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=65536"}, set()),
        ({heap_trim.TUNE_ENV: "0"}, set()),
        ({heap_trim.TUNE_ENV: "1", "MALLOC_ARENA_MAX": "4"}, {"mmap_threshold"}),
    ],
)
def test_glibcs_own_settings_and_the_switch_win(environ: dict[str, str], left: set[str]):
    assert set(heap_trim.tuning(environ)) == left


def test_the_switch_refuses_nonsense():
    with pytest.raises(ValueError, match=heap_trim.TUNE_ENV):
        heap_trim.tuning({heap_trim.TUNE_ENV: "yes"})
