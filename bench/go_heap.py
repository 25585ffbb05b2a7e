"""Go heap profiles of nats-server, read from its `--profile` port, so a soak can say what
in the server grows: the live bytes per allocation site between two profiles, and the
runtime's own accounting (live heap, heap the runtime holds but has not returned to the OS).

The text profile (`/debug/pprof/heap?debug=1&gc=1`: a GC first, so "in use" is live) holds
sampled allocations: each record is scaled by 1 / (1 - exp(-size / rate)), as `go tool
pprof` does, to estimate the bytes it stands for.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import httpx

HEADER = re.compile(r"^heap profile: .* @ heap/(\d+)")
RECORD = re.compile(r"^(\d+): (\d+) \[(\d+): (\d+)\] @")
PREFIX = "github.com/nats-io/nats-server/v2/"
RUNTIME = ("runtime.", "runtime/", "sync.", "internal/")
MEMSTATS = ("HeapAlloc", "HeapInuse", "HeapIdle", "HeapReleased", "HeapSys", "Sys", "NumGC")


@dataclass
class GoHeap:
    sites: dict[str, float] = field(default_factory=dict)  # live bytes by allocation site
    memstats: dict[str, int] = field(default_factory=dict)


def site_of(frames: list[str]) -> str:
    """The allocation site: the first frame outside the Go runtime, with its caller."""
    funcs = [f.removeprefix(PREFIX) for f in frames if not f.startswith(RUNTIME)]
    return " <- ".join(funcs[:2]) if funcs else (frames[0] if frames else "?")


def parse(text: str) -> GoHeap:
    heap = GoHeap()
    rate = 512 * 1024
    count = size = 0
    frames: list[str] = []

    def close() -> None:
        if count > 0 and size > 0:
            scale = 1.0 / (1.0 - math.exp(-(size / count) / rate))
            key = site_of(frames)
            heap.sites[key] = heap.sites.get(key, 0.0) + size * scale

    for line in text.splitlines():
        if m := HEADER.match(line):
            rate = max(1, int(m.group(1)) // 2)  # the header carries twice the sampling rate
        elif m := RECORD.match(line):
            close()
            count, size, frames = int(m.group(1)), int(m.group(2)), []
        elif line.startswith("#\t0x"):
            parts = line.split("\t")
            if len(parts) >= 3:
                frames.append(parts[2].split("+0x", 1)[0])
        elif line.startswith("# ") and " = " in line:
            name, _, value = line[2:].partition(" = ")
            if name in MEMSTATS and value.strip().isdigit():
                heap.memstats[name] = int(value)
    close()
    return heap


def fetch(port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> GoHeap:
    r = httpx.get(f"http://{host}:{port}/debug/pprof/heap", params={"debug": 1, "gc": 1}, timeout=timeout)
    r.raise_for_status()
    return parse(r.text)


def try_fetch(port: int | None) -> GoHeap | None:
    """A profile, or None when there is no port or the server does not answer (a soak's
    result must not be lost to its profiler)."""
    if port is None:
        return None
    try:
        return fetch(port)
    except httpx.HTTPError:
        return None


def growth(before: GoHeap, after: GoHeap, most: int = 15) -> list[list[object]]:
    """The sites whose live bytes grew most (MiB before, after, change)."""
    mib = 1 / (1 << 20)
    rows = [
        (after.sites.get(k, 0.0) - before.sites.get(k, 0.0), k) for k in set(before.sites) | set(after.sites)
    ]
    rows.sort(reverse=True)
    return [
        [
            k,
            f"{before.sites.get(k, 0.0) * mib:.2f}",
            f"{after.sites.get(k, 0.0) * mib:.2f}",
            f"{d * mib:+.2f}",
        ]
        for d, k in rows[:most]
    ]


def memstats_rows(before: GoHeap, after: GoHeap) -> list[list[object]]:
    def cell(h: GoHeap, k: str) -> str:
        v = h.memstats.get(k)
        return "-" if v is None else (str(v) if k == "NumGC" else f"{v / (1 << 20):.1f}")

    return [[k, cell(before, k), cell(after, k)] for k in MEMSTATS]
