"""Heap profiling for the soak, loaded by every Python process it starts (the soak puts this
directory first on PYTHONPATH) and inert unless FLEET_HEAP_PROFILE_DIR is set. The first
SIGUSR2 starts tracemalloc (at the end of the warm-up: tracing from the start would make
every import several times slower); each later SIGUSR2 appends to <dir>/<pid>.txt the
allocation sites holding the most memory allocated since then and still alive — what the
process grew by. Not part of the product: tracing slows a process and grows its memory."""

from __future__ import annotations

import os

if os.environ.get("FLEET_HEAP_PROFILE_DIR"):
    import collections
    import ctypes
    import gc
    import signal
    import sys
    import time
    import tracemalloc
    from pathlib import Path

    class _MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                "fsmblks", "uordblks", "fordblks", "keepcost",
            )
        ]  # fmt: skip

    _types_at_start: collections.Counter[str] = collections.Counter()

    def _allocator(f) -> None:
        """Where RSS lives outside the traced heap: glibc's own view (in use vs free inside
        its heap: fragmentation) and the count of live objects per type (a leak of
        objects shows here even when tracing began after they were allocated)."""
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = _MallInfo2
            m = libc.mallinfo2()
            mib = 2**20
            f.write(
                f"glibc: in use {m.uordblks / mib:.1f} MiB, free in heap {m.fordblks / mib:.1f} MiB, "
                f"mmapped {m.hblkhd / mib:.1f} MiB ({m.hblks} blocks), arena {m.arena / mib:.1f} MiB\n"
            )
        except (OSError, AttributeError):
            pass
        f.write(f"python: {sys.getallocatedblocks()} allocated blocks\n")
        gc.collect()  # count what is alive, not the cyclic garbage the next collection frees
        types = collections.Counter(type(o).__name__ for o in gc.get_objects())
        if not _types_at_start:
            _types_at_start.update(types)
            return
        grown = (types - _types_at_start).most_common(10)
        f.write("live objects grown by type: " + ", ".join(f"{n} +{c}" for n, c in grown) + "\n")
        _holders(f)

    def _holders(f) -> None:
        """Where live exceptions were raised and what live sockets point at: a leak of
        either names its code here, which an allocation site (the exception's own
        constructor, the socket module) does not."""
        raised: collections.Counter[str] = collections.Counter()
        peers: collections.Counter[str] = collections.Counter()
        for o in gc.get_objects():
            if isinstance(o, BaseException) and o.__traceback__ is not None:
                tb = o.__traceback__
                while tb.tb_next is not None:
                    tb = tb.tb_next
                code = tb.tb_frame.f_code
                raised[f"{type(o).__name__} at {code.co_filename.rsplit('/', 2)[-1]}:{tb.tb_lineno}"] += 1
            elif type(o).__name__ == "socket":
                try:
                    peer = o.getpeername()
                    peers[f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)] += 1
                except (OSError, AttributeError, IndexError):
                    peers["(closed or unconnected)"] += 1
        f.write(
            "live exceptions by where raised: "
            + ", ".join(f"{k} x{c}" for k, c in raised.most_common(8))
            + "\n"
        )
        f.write("live sockets by peer: " + ", ".join(f"{k} x{c}" for k, c in peers.most_common(8)) + "\n")

    def _dump(_signum: int, _frame: object) -> None:
        out = Path(os.environ["FLEET_HEAP_PROFILE_DIR"]) / f"{os.getpid()}.txt"
        with out.open("a") as f:
            f.write(f"== {time.strftime('%H:%M:%S')} {' '.join(sys.argv)[:160]}\n")
            _allocator(f)
            if not tracemalloc.is_tracing():
                tracemalloc.start(int(os.environ.get("FLEET_HEAP_PROFILE_FRAMES", "6")))
                f.write("tracing from here\n")
                return
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            total = sum(s.size for s in snap.statistics("filename"))
            f.write(f"{total / 2**20:.2f} MiB allocated since tracing began and still alive\n")
            for stat in snap.statistics("traceback")[:12]:
                f.write(f"{stat.size / 2**10:.1f} KiB in {stat.count} blocks\n")
                for line in stat.traceback.format(limit=4):
                    f.write(f"    {line}\n")

    signal.signal(signal.SIGUSR2, _dump)
