"""How many more batch lines may start on a deployment now: the spare-capacity gate.

Batch work runs only in capacity interactive traffic is not using, read from what the
engines report (each ready replica's `ReplicaLoad`: requests waiting in its scheduler, KV
cache usage) and from this gateway's own queue, never from errors: an engine accepts far
more than it can serve without a 429, so an error-driven throttle never triggers.

Nothing starts while any ready replica has anyone waiting or its KV cache at
`max_kv_usage`, or interactive requests wait in this gateway's queue for the deployment;
otherwise up to `per_replica` lines per ready replica, less those in flight here. Plain
and synchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fleet_base.batch.config import BatchConfig
from fleet_base.protocol import ReplicaLoad

Reason = Literal["spare", "no_replica", "engine_queue", "kv_cache", "gateway_queue", "full"]


@dataclass(frozen=True)
class Spare:
    lines: int  # more lines that may start now
    reason: Reason  # why (the first gate that closed, or "spare")


def spare_lines(
    loads: Sequence[ReplicaLoad], in_flight: int, interactive_waiting: int, config: BatchConfig
) -> Spare:
    """`loads`: the deployment's ready replicas here; `in_flight`: batch lines running
    here; `interactive_waiting`: this gateway's queue for the deployment."""
    if not loads:
        return Spare(0, "no_replica")
    if interactive_waiting > 0:
        return Spare(0, "gateway_queue")
    if any(load.waiting > 0 for load in loads):
        return Spare(0, "engine_queue")
    if any(load.kv_cache_usage >= config.max_kv_usage for load in loads):
        return Spare(0, "kv_cache")
    room = config.per_replica * len(loads) - max(0, in_flight)
    return Spare(room, "spare") if room > 0 else Spare(0, "full")
