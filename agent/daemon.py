"""The cluster agent: watch this cluster's desired state over NATS, reconcile replicas
through a runtime, keep the gateway's files current, report heartbeats and events.

Files under `state_dir` (atomic writes; see fleet_base/local_state.py):
- desired.json, routes.json, keys.json: the last DesiredState / RouteSet / KeySet seen on
  NATS (deletions included). Loaded FIRST on start, so a restart while NATS or the
  control plane is down reconciles and serves from them.
- fence.json: FenceState, the highest control-plane epoch seen per KV bucket and the
  values refused below it (agent.fencing).
- replicas.json: ReplicaSnapshot of every replica (state, url, load), rewritten on every
  change and at least each second; the gateway routes from it.
- runtime.json: RuntimeFile, the runtime handle of each replica (pid, port, url, spec,
  restarts), for adoption.
- logs/<replica_id>.log: each replica's stdout and stderr.
- agent.lock: held while an agent runs, so two agents never share a state_dir.

Lifetime of replicas versus the agent (a deliberate choice):
- SIGTERM / SIGINT: the agent drains its replicas (SIGTERM, bounded by the replica
  drain timeout), reports them stopped and exits 0. A second signal exits at once.
  Except where the runtime's replicas are the cluster's, not the agent's
  (`Runtime.drain_on_exit` False: kubernetes pods): an agent pod that is rescheduled or
  upgraded leaves them serving, and the next agent adopts them by their labels.
- SIGKILL (or a crash) of the agent: replicas run in their own sessions and keep
  serving. A restarted agent re-adopts each replica in runtime.json whose pid is alive,
  is the same process (start time and `engine.server` + port on its command line, so a
  reused pid is never adopted) and answers /health; anything else is started afresh.
  Serving therefore survives agent upgrades and crashes without duplicate replicas.

Absence is not deletion for the desired state: if NATS has no key for this cluster at
connect, the copy on disk stays in force (the control plane may not have written yet); an
explicit delete of the key means "run nothing". Routes and keys are made equal to NATS
at every (re)connect, so a key revoked while the agent was away is dropped.

`Agent` only wires the controllers that do this: three `agent.mirror.BucketMirror`s
(desired state, routes, keys), the `ReplicaController` (reconcile through a runtime), the
`AdapterController` (LoRA catalogs on ready replicas) and the `Reporter` (heartbeats,
replica load, KV events).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from typing import IO

import httpx

from agent.adapter_controller import AdapterController
from agent.adapters import ReplicaAdapters, replica_cache_root
from agent.capacity import CapacitySignals
from agent.fencing import EpochFence
from agent.health.monitor import NodeHealthMonitor
from agent.inventory import inventory
from agent.kv_relay import KvRelay
from agent.mirror import BucketMirror, decode_entry, desired_mirror, key_mirror, retry_unsaved, route_mirror
from agent.models import ModelPuller
from agent.replica import Replica, ReplicaEvents, ReplicaFiles
from agent.replica_controller import ReplicaController
from agent.replica_metrics import MetricsScraper
from agent.reporter import Reporter
from agent.runtime import Runtime, make_runtime
from agent.security.replica_auth import replica_headers
from fleet_base import protocol
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState, ReplicaSnapshot
from fleet_base.models import ModelCache
from fleet_base.nats_io import NatsLink, redact_url
from fleet_base.protocol import DesiredState, Heartbeat, ModelCommand
from fleet_base.security.tls import nats_tls, replica_verify
from fleet_base.subjects import permits

log = logging.getLogger("agent")

RECONCILE_INTERVAL_S = 0.5


class AgentLocked(Exception):
    """Another agent holds this state_dir."""


class Agent:
    def __init__(
        self,
        config: ClusterConfig,
        runtime: Runtime | None = None,
        *,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.cluster = config.cluster
        self.files = LocalState(config.state_dir)
        self.runtime = runtime or make_runtime(config)
        self.link = NatsLink(
            config.nats_url,
            name=f"fleet-agent-{config.cluster}",
            tls=nats_tls(config.security, "agent", config.cluster),
            manage_jetstream=not config.security.enabled,  # with identities, the control plane's job
            permits=permits("agent", config.cluster),
        )
        verify = replica_verify(config.security)
        capacity = CapacitySignals(hold_s=config.kubernetes.unschedulable_hold_s)
        scraper = MetricsScraper(verify=verify, headers=replica_headers(config.security))
        cache = ModelCache(config.model_cache_dir, config.model_cache_max_bytes)
        self.models = ModelPuller(cache, on_change=lambda: self.replica_controller.wake())
        self.fence = EpochFence(self.files)  # agent.fencing: shared by the three mirrors
        self.desired_mirror = desired_mirror(
            self.link,
            self.files,
            self.cluster,
            on_change=lambda: self.replica_controller.wake(),
            fence=self.fence,
        )
        self.route_mirror = route_mirror(self.link, self.files, self.fence)
        self.key_mirror = key_mirror(self.link, self.files, self.fence)
        self.replica_controller = ReplicaController(
            runtime=self.runtime,
            config=config.replica,
            desired=lambda: self.desired,
            files=ReplicaFiles(self.files, self.cluster, self.runtime.name),
            events=ReplicaEvents(self.link, self.cluster),
            models=self.models,
            prepull=self.runtime.name == "process" or config.model_cache_dir is not None,
            scraper=scraper,
            capacity=capacity,
            clock=clock,
            interval_s=reconcile_interval_s,
        )
        self.adapter_controller = AdapterController(
            api=ReplicaAdapters(
                httpx.AsyncClient(timeout=10.0, verify=verify),
                replica_headers(config.security),
                cache,
                replica_cache_root(config),
            ),
            replicas=lambda: self.replicas,
            desired=lambda: self.desired,
            interval_s=min(1.0, config.heartbeat_interval_s),
            on_in_use=self.models.use_adapters,
        )
        self.health = NodeHealthMonitor(
            config=config,
            runtime=self.runtime,
            replicas=lambda: self.replicas,
            desired=lambda: self.desired,
            files=self.files,
            clock=clock,
            headers=replica_headers(config.security),
            http=httpx.AsyncClient(timeout=config.health.probe_timeout_s, verify=verify),
        )
        self.reporter = Reporter(
            config=config,
            link=self.link,
            files=self.files,
            replicas=lambda: self.replicas,
            desired=lambda: self.desired,
            capacity=capacity,
            models=self.models,
            scraper=scraper,
            # replicas' KV events -> fleet.v1.kvcache (the replica token and CA as the gateway uses)
            kv_relay=KvRelay(
                self.link, config.cluster, verify=verify, headers=replica_headers(config.security)
            ),
            clock=clock,
            health=self.health,
            fence=self.fence,
        )
        self._lockfile: IO[str] | None = None
        self.link.on_connect(self._on_connect)
        self.link.respond(protocol.models_subject(self.cluster), self._on_models_command)

    @property
    def desired(self) -> DesiredState | None:
        return self.desired_mirror.entries.get(self.cluster)

    @desired.setter
    def desired(self, desired: DesiredState) -> None:
        self.desired_mirror.entries[self.cluster] = desired

    @property
    def mirrors(self) -> tuple[BucketMirror, ...]:
        return (self.desired_mirror, self.route_mirror, self.key_mirror)

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.replica_controller.replicas

    def snapshot(self) -> ReplicaSnapshot:
        return self.replica_controller.snapshot()

    def heartbeat(self) -> Heartbeat:
        return self.reporter.heartbeat()

    async def reconcile_once(self) -> None:
        await self.replica_controller.reconcile_once()

    # ================================================================= lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain every replica and return."""
        self._acquire_lock()
        try:
            self.load_from_disk()
            await self.replica_controller.adopt()
            await self.reconcile_once()  # serve from disk before NATS (or nvidia-smi) answers
            self.reporter.pools = await asyncio.to_thread(inventory, self.config)
            self.health.gpus = sum(p.gpus_per_node for p in self.reporter.pools)
            log.info(
                "cluster %s: pools %s",
                self.cluster,
                ", ".join(f"{p.name}x{p.gpus_per_node}" for p in self.reporter.pools),
            )
            self.link.start()
            loops = [
                asyncio.create_task(self.replica_controller.run(), name="reconcile"),
                asyncio.create_task(self.reporter.heartbeats(), name="heartbeat"),
                asyncio.create_task(self.reporter.metrics(), name="metrics"),
                asyncio.create_task(self.adapter_controller.run(), name="adapters"),
                *(
                    [asyncio.create_task(self.health.run(), name="health")]
                    if self.config.health.enabled
                    else []
                ),
                asyncio.create_task(retry_unsaved(self.mirrors), name="state-retry"),
            ]
            await stop.wait()
            log.info("stopping: draining %d replicas", len(self.replicas))
            async with self.replica_controller.lock:  # never cut a reconcile pass in half
                for task in loops:
                    task.cancel()
            for task in loops:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for mirror in self.mirrors:
                await mirror.close()
            await self.reporter.kv_relay.close()
            if self.runtime.drain_on_exit:
                await self.replica_controller.drain()
            else:
                log.info("leaving %d replicas running for the next agent", len(self.replicas))
                self.replica_controller.persist(force=True)
            await self.models.close()
            await self.link.close()
        finally:
            await self.reporter.scraper.close()
            await self.adapter_controller.close()
            await self.health.close()
            await self.runtime.close()
            self._release_lock()

    def load_from_disk(self) -> None:
        """The desired state, routes and keys last seen on NATS."""
        for mirror in self.mirrors:
            mirror.load()

    def _acquire_lock(self) -> None:
        self.files.dir.mkdir(parents=True, exist_ok=True)
        f = open(self.files.dir / "agent.lock", "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise AgentLocked(f"another agent is running on {self.files.dir}") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lockfile = f

    def _release_lock(self) -> None:
        if self._lockfile is not None:
            self._lockfile.close()
            self._lockfile = None

    async def _on_connect(self) -> None:
        log.info("connected to NATS at %s", redact_url(self.config.nats_url))
        await self.reporter.publish_heartbeat()

    async def _on_models_command(self, data: bytes) -> protocol.Message:
        command = decode_entry(ModelCommand, "models", data)
        if command is None:
            return protocol.ModelCommandReply(ok=False, message="malformed model command")
        return await self.models.command(command)
