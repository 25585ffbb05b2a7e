"""Give the C heap's free pages back to the kernel, on a timer, in long-running processes.

glibc's malloc returns memory to the kernel only from the top of its heap. A Python server
that serves many short requests frees most of what each one allocated, but the freed chunks
sit between live ones, so RSS ratchets up with fragmentation while the bytes in use stay
flat (the soak's glibc dump shows free-in-heap growing from 2 to 10 MiB in a gateway
over half an hour). `malloc_trim(0)` walks every arena and releases the whole free pages
inside it with `madvise(MADV_DONTNEED)`; it runs on a daemon thread (ctypes drops the GIL
for the call) so the event loop never waits on it. On a libc without it (musl, macOS) the
trimmer says so once and does nothing.

Trimming cannot return a page that still holds one live chunk, so `tune()` also keeps big
buffers out of the heap: glibc raises its mmap threshold to the size of every mmapped
block freed (up to 32 MiB), so after one large request body every later body of that size
is carved from the heap, between small live objects, where its pages are never whole again.
A fixed threshold keeps them mmapped (returned whole on free), and a cap of two arenas
keeps the worker threads that parse bodies from each fragmenting an arena of its own (the
GIL serialises them anyway). glibc's own settings (`MALLOC_ARENA_MAX`,
`MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`) win over these; FLEET_MALLOC_TUNE=0 leaves glibc's
defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping

log = logging.getLogger(__name__)

ENV = "FLEET_MALLOC_TRIM_INTERVAL_S"
TUNE_ENV = "FLEET_MALLOC_TUNE"
DEFAULT_INTERVAL_S = 60.0

_started: threading.Event | None = None

# What `tune()` sets: name -> (mallopt(3) parameter, value, glibc's environment variable and
# tunable for it, either of which leaves the parameter to glibc).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_SETTINGS = {
    "mmap_threshold": (M_MMAP_THRESHOLD, 128 * 1024, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    "arena_max": (M_ARENA_MAX, 2, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
}


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def tuning(environ: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """What `tune()` sets, by name: (mallopt parameter, value), less what glibc's own
    settings in `environ` chose; nothing with FLEET_MALLOC_TUNE=0."""
    switch = environ.get(TUNE_ENV, "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{TUNE_ENV} must be 0 (glibc's defaults) or 1, got {switch!r}")
    if switch == "0":
        return {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {
        name: (param, value)
        for name, (param, value, env_name, tunable) in _SETTINGS.items()
        if env_name not in environ and tunable not in tunables
    }


def tune(names: Collection[str] | None = None) -> dict[str, int]:
    """Fix the mmap threshold and cap the arenas (see the module's docstring; `names`: only
    those), except where glibc's own settings chose; returns what was set (empty without
    glibc's `mallopt`)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return {
        name: value
        for name, (param, value) in tuning(os.environ).items()
        if (names is None or name in names) and mallopt(param, value) == 1
    }


def trim() -> bool | None:
    """Release free heap pages now: True if any were released, None where the libc has no
    `malloc_trim`."""
    fn = _malloc_trim()
    return None if fn is None else bool(fn(0))


def interval_from_env(environ: dict[str, str] | None = None) -> float:
    """Seconds between trims from FLEET_MALLOC_TRIM_INTERVAL_S (0 turns it off)."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    if not raw.strip():
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"{ENV} must be a number of seconds, got {raw!r}") from err
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{ENV} must be a finite number of seconds >= 0, got {raw!r}")
    return value


def start(interval_s: float | None = None, tune_allocator: bool = True) -> threading.Event | None:
    """Tune the allocator (not in a process whose big buffers are reused tensors: a fixed
    threshold would map and fault in each one afresh) and start the process's one trimmer
    thread (later calls return the same stop event); None when trimming is off or unsupported."""
    global _started
    if _started is not None:
        return _started
    if tune_allocator:
        tune()
    every = interval_from_env() if interval_s is None else interval_s
    if every <= 0:
        return None
    fn = _malloc_trim()
    if fn is None:
        log.info("malloc_trim is not in this libc: freed heap pages stay with the process")
        return None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            fn(0)

    threading.Thread(target=run, name="heap-trim", daemon=True).start()
    _started = stop
    return stop
