"""The wire contract of a request's priority class between a gateway and its replicas (a
Fleet extension).

A gateway sends every request to a replica with `PRIORITY_CLASS_HEADER` naming the class it
was admitted in (the key's, or `batch` for batch and async work); a client's own copy of
the header never passes a gateway. The engine maps the class to its scheduler priority
(lower value = more important): `batch` runs after everything else and is preempted first;
every other class, and a request without the header, gets the default.
"""

from __future__ import annotations

PRIORITY_CLASS_HEADER = "X-Fleet-Priority-Class"
BATCH_CLASS = "batch"
DEFAULT_PRIORITY = 0
BATCH_PRIORITY = 10  # after every default request, whatever the engine's own use of 1..9


def engine_priority(klass: str | None) -> int:
    """The scheduler priority of a request admitted in `klass` (None: no header)."""
    return BATCH_PRIORITY if (klass or "").strip().lower() == BATCH_CLASS else DEFAULT_PRIORITY
