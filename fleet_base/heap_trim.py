"""Give the C heap's free pages back to the kernel, on a timer, in long-running processes.

glibc's malloc returns memory to the kernel only from the top of its heap. A Python server
that serves many short requests frees most of what each one allocated, but the freed chunks
sit between live ones, so RSS ratchets up with fragmentation while the bytes in use stay
flat (the soak's glibc dump shows free-in-heap growing from 2 to 10 MiB in a gateway
over half an hour). `malloc_trim(0)` walks every arena and releases the whole free pages
inside it with `madvise(MADV_DONTNEED)`; it runs on a daemon thread (ctypes drops the GIL
for the call) so the event loop never waits on it. On a libc without it (musl, macOS) the
trimmer says so once and does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

ENV = "FLEET_MALLOC_TRIM_INTERVAL_S"
DEFAULT_INTERVAL_S = 60.0

_started: threading.Event | None = None


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


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


def start(interval_s: float | None = None) -> threading.Event | None:
    """Start the process's one trimmer thread (later calls return the same stop event);
    None when turned off or unsupported."""
    global _started
    if _started is not None:
        return _started
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
