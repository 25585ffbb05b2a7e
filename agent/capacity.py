"""What the heartbeat says about capacity the cluster lacks: replicas whose spot node was
reclaimed (`Heartbeat.preempted`) and replicas the cluster cannot schedule
(`Heartbeat.unschedulable`), and the pools shrunk to what the cluster really holds.

A pool declares N nodes; when one of its replicas is unschedulable, the cluster holds only
the GPUs its scheduled replicas use. For `hold_s` after the last such sighting the pool is
reported with that many nodes (rounded up), so the control plane's placer moves the
unschedulable replica elsewhere instead of straight back; after that the declared size
returns (a cluster autoscaler may have added nodes meanwhile). Preempted replica ids are
repeated for `report_s`, so a heartbeat lost on the way does not lose the signal (the
control plane applies them idempotently). Pure and synchronous: the caller passes `now`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleet_base.protocol import PoolInventory

PREEMPTED_REPORT_S = 30.0


@dataclass(frozen=True)
class Placed:
    """One replica as capacity sees it."""

    replica_id: str
    pool: str
    gpus: int
    unschedulable: bool


@dataclass
class CapacitySignals:
    hold_s: float = 600.0
    report_s: float = PREEMPTED_REPORT_S
    # pool -> (last unschedulable sighting, GPUs its scheduled replicas held then)
    short: dict[str, tuple[float, int]] = field(default_factory=dict)
    preempted_at: dict[str, float] = field(default_factory=dict)
    unschedulable: list[str] = field(default_factory=list)

    def observe(self, replicas: list[Placed], now: float) -> None:
        self.unschedulable = sorted(r.replica_id for r in replicas if r.unschedulable)
        for pool in {r.pool for r in replicas if r.unschedulable}:
            held = sum(r.gpus for r in replicas if r.pool == pool and not r.unschedulable)
            self.short[pool] = (now, held)

    def preempt(self, replica_id: str, now: float) -> None:
        self.preempted_at[replica_id] = now

    def preempted(self, now: float) -> list[str]:
        for rid, at in list(self.preempted_at.items()):
            if now - at > self.report_s:
                del self.preempted_at[rid]
        return sorted(self.preempted_at)

    def pools(self, declared: list[PoolInventory], now: float) -> list[PoolInventory]:
        out = []
        for pool in declared:
            seen = self.short.get(pool.name)
            if seen is not None and now - seen[0] > self.hold_s:
                del self.short[pool.name]
                seen = None
            if seen is None:
                out.append(pool)
                continue
            nodes = min(pool.nodes, math.ceil(seen[1] / max(1, pool.gpus_per_node)))
            out.append(pool.model_copy(update={"nodes": nodes}))
        return out
