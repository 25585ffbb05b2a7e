"""The reporter: what this cluster tells the control plane and the gateway. Heartbeats
(pools and their capacity, replicas, model pulls, queue depth) on NATS; replica load
scraped from each ready replica's /metrics; each ready replica's KV events relayed to
fleet.v1.kvcache."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from agent import engine_kv_snapshot
from agent.capacity import CapacitySignals, Placed
from agent.fencing import EpochFence
from agent.health.monitor import NodeHealthMonitor
from agent.kv_relay import Followed, KvRelay
from agent.models import ModelPuller
from agent.replica import Replica, ready_replicas
from agent.replica_metrics import MetricsScraper
from fleet_base import protocol
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import DesiredState, Heartbeat, PoolInventory, ReplicaState


@dataclass(eq=False)
class Reporter:
    """Heartbeats and replica load for this cluster (`replicas()` as they are now)."""

    config: ClusterConfig
    link: NatsLink
    files: LocalState
    replicas: Callable[[], dict[str, Replica]]
    desired: Callable[[], DesiredState | None]
    capacity: CapacitySignals
    models: ModelPuller
    scraper: MetricsScraper
    kv_relay: KvRelay
    clock: Callable[[], float]
    pools: list[PoolInventory] = field(default_factory=list)
    health: NodeHealthMonitor | None = None  # nodes, faults, and the capacity it withholds
    fence: EpochFence | None = None  # the control-plane epochs obeyed (heartbeats report the highest)
    _engine_kv_saved: Counter[tuple[str, str]] = field(default_factory=Counter)

    def heartbeat(self) -> Heartbeat:
        replicas = self.replicas()
        statuses = [r.status() for r in sorted(replicas.values(), key=lambda r: r.replica_id)]
        now = self.clock()
        self.capacity.observe(
            [
                Placed(
                    r.replica_id,
                    r.spec.pool,
                    r.spec.resources.gpu_count,
                    r.unschedulable and r.state == ReplicaState.starting,
                )
                for r in replicas.values()
                if r.state in (ReplicaState.starting, ReplicaState.ready, ReplicaState.draining)
            ],
            now,
        )
        desired = self.desired()
        pools = self.capacity.pools(self.pools, now)
        return Heartbeat(
            cluster=self.config.cluster,
            provider=self.config.provider,
            region=self.config.region,
            coordinates=self.config.coordinates,
            gateway_url=self.config.gateway.url,
            pools=self.health.pools(pools) if self.health is not None else pools,
            replicas=statuses,
            preempted=self.capacity.preempted(now),
            unschedulable=self.capacity.unschedulable,
            models=self.models.report(),
            desired_generation=desired.generation if desired is not None else -1,
            fence_epoch=self.fence.highest() if self.fence is not None else 0,
            queue_depth=sum(s.load.waiting for s in statuses) + self._gateway_queue_depth(),
            tokens_per_s=sum(s.load.tokens_per_s for s in statuses),
            state_writes_failing={n: why[:64] for n, why in sorted(self.files.writes.failing.items())[:16]},
            state_write_failures=self.files.writes.total,
            nodes=self.health.nodes() if self.health is not None else [],
            node_faults=self.health.faults(now) if self.health is not None else [],
        )

    def _gateway_queue_depth(self) -> int:
        """Requests queued at this cluster's gateway (its gateway.json)."""
        status = self.files.load_gateway()
        return status.queue_depth if status is not None else 0

    async def publish_heartbeat(self) -> None:
        await self.link.publish(protocol.heartbeat_subject(self.config.cluster), self.heartbeat())

    async def heartbeats(self) -> None:
        while True:
            await self.publish_heartbeat()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _save_engine_kv_counts(self) -> None:
        """engine_kv_events.json for the gateway's /metrics, when the counts moved."""
        counts = self.kv_relay.engine_counts
        if counts and counts != self._engine_kv_saved:
            engine_kv_snapshot.save(self.files, counts)
            self._engine_kv_saved = Counter(counts)

    async def metrics(self) -> None:
        """Follow the ready replicas: their load (for heartbeats and replicas.json) and
        their KV events."""
        while True:
            ready = ready_replicas(self.replicas())
            self.kv_relay.sync(
                [
                    Followed(r.replica_id, r.spec.deployment, r.handle.url, r.spec.engine)
                    for r in ready
                    if r.handle
                ]
            )
            self._save_engine_kv_counts()
            loads = await asyncio.gather(
                *(
                    self.scraper.scrape(r.replica_id, r.handle.url, engine=r.spec.engine)
                    for r in ready
                    if r.handle
                )
            )
            for r, load in zip(ready, loads):
                if load is not None and r.state == ReplicaState.ready:
                    r.load = load
                    r.startup.update(self.scraper.startup(r.replica_id))
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s))
