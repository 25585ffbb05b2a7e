"""One replica as the agent sees it (`Replica`), and what the agent writes about its
replicas: replicas.json for the gateway, runtime.json for adoption, and lifecycle events
on NATS."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from agent.reconciler import ReplicaRecord
from agent.runtime import ReplicaHandle
from fleet_base import protocol
from fleet_base.engines import CAPABILITIES
from fleet_base.local_state import LocalState, ReplicaSnapshot
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import Event, EventKind, ReplicaLoad, ReplicaSpec, ReplicaState, ReplicaStatus

log = logging.getLogger("agent")

SNAPSHOT_EVERY_S = 1.0


class RuntimeFile(BaseModel):
    """runtime.json: the handles of the replicas this agent runs, for adoption."""

    runtime: str = "process"
    replicas: dict[str, ReplicaHandle] = Field(default_factory=dict)


@dataclass
class Replica:
    """The agent's live view of one replica."""

    spec: ReplicaSpec
    state: ReplicaState = ReplicaState.pending
    handle: ReplicaHandle | None = None
    restarts: int = 0
    streak: int = 0  # crashes since it last stayed ready for a while (backoff exponent)
    started_at: float | None = None
    ready_since: float | None = None
    cold_start_s: float | None = None  # started_at -> first ready of the latest start
    pull_since: float | None = None  # waiting for its model in the node cache since
    startup: dict[str, float] = field(default_factory=dict)  # pull/load/warmup/first_token seconds
    failed_at: float | None = None
    next_restart_at: float | None = None
    last_error: str = ""
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    unschedulable: bool = False  # the runtime cannot place it (kubernetes: pod Unschedulable)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded on it (its /v1/models)
    adapters_seeded: bool = False  # the agent preloaded its share of the catalog

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    def record(self) -> ReplicaRecord:
        return ReplicaRecord(
            replica_id=self.replica_id,
            spec=self.spec,
            state=self.state,
            restarts=self.restarts,
            failed_at=self.failed_at,
            next_restart_at=self.next_restart_at,
        )

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            replica_id=self.replica_id,
            deployment=self.spec.deployment,
            version=self.spec.version,
            state=self.state,
            url=self.handle.url if self.handle is not None else "",
            pool=self.spec.pool,
            pid=self.handle.pid if self.handle is not None else None,
            restarts=self.restarts,
            started_at=self.started_at,
            last_error=self.last_error[-2000:],
            load=self.load if self.state == ReplicaState.ready else ReplicaLoad(),
            cold_start_s=self.cold_start_s,
            unschedulable=self.unschedulable,
            pull_s=self.startup.get("pull"),
            load_s=self.startup.get("load"),
            warmup_s=self.startup.get("warmup"),
            first_token_s=self.startup.get("first_token"),
            adapters=list(self.adapters) if self.state == ReplicaState.ready else [],
            max_adapters=lora_slots(self.spec),
            adapter_uris={a.name: a.uri for a in self.spec.adapters},
            engine=self.spec.engine,
            note=self.handle.note[:512] if self.handle is not None else "",
        )


def lora_slots(spec: ReplicaSpec) -> int:
    """Adapters the replica can load while it runs: none where its engine cannot."""
    return spec.max_adapters if CAPABILITIES[spec.engine].lora_load else 0


def ready_replicas(replicas: dict[str, Replica]) -> list[Replica]:
    """The replicas serving now (ready, with a handle)."""
    return [r for r in replicas.values() if r.state == ReplicaState.ready and r.handle is not None]


class ReplicaFiles:
    """replicas.json (rewritten on every change and at least each second) and runtime.json
    (rewritten when a handle changes)."""

    def __init__(self, files: LocalState, cluster: str, runtime: str) -> None:
        self.files = files
        self.cluster = cluster
        self.runtime = runtime
        self._last_snapshot = ""
        self._last_snapshot_at = 0.0
        self._last_runtime = ""

    @property
    def runtime_path(self) -> Path:
        return self.files.dir / "runtime.json"

    def saved_handles(self) -> dict[str, ReplicaHandle]:
        """The handles runtime.json holds (none if it is missing or unreadable)."""
        try:
            return RuntimeFile.model_validate_json(self.runtime_path.read_bytes()).replicas
        except (FileNotFoundError, ValidationError, ValueError):
            return {}

    def snapshot(self, replicas: dict[str, Replica]) -> ReplicaSnapshot:
        return ReplicaSnapshot(
            cluster=self.cluster,
            replicas=[r.status() for r in sorted(replicas.values(), key=lambda r: r.replica_id)],
        )

    def write_snapshot(self, replicas: dict[str, Replica], force: bool = False) -> None:
        snap = self.snapshot(replicas)
        body = json.dumps([s.model_dump(mode="json") for s in snap.replicas], sort_keys=True)
        now = time.monotonic()
        if force or body != self._last_snapshot or now - self._last_snapshot_at >= SNAPSHOT_EVERY_S:
            self.files.save_replicas(snap)
            self._last_snapshot = body
            self._last_snapshot_at = now

    def write_runtime(self, replicas: dict[str, Replica]) -> None:
        handles = {}
        for rid, r in sorted(replicas.items()):
            if r.handle is not None:
                r.handle.restarts = r.restarts
                handles[rid] = r.handle
        body = RuntimeFile(runtime=self.runtime, replicas=handles).model_dump_json(indent=1)
        if body != self._last_runtime:
            self.files.write_bytes(self.runtime_path, body.encode())
            self._last_runtime = body


class ReplicaEvents:
    """Replica lifecycle events: logged, and published on the cluster's events subject."""

    def __init__(self, link: NatsLink, cluster: str) -> None:
        self.link = link
        self.cluster = cluster
        self._background: set[asyncio.Task[None]] = set()

    async def emit(self, kind: EventKind, r: Replica, message: str = "") -> None:
        if kind != "replica_failed":  # failures are logged with their backoff
            log.info(
                "replica %s (%s v%d): %s %s", r.replica_id, r.spec.deployment, r.spec.version, kind, message
            )
        event = Event(
            cluster=self.cluster,
            kind=kind,
            message=message,
            deployment=r.spec.deployment,
            replica_id=r.replica_id,
        )
        await self.link.publish(protocol.events_subject(self.cluster), event)

    def emit_soon(self, kind: EventKind, r: Replica, message: str) -> None:
        task = asyncio.get_running_loop().create_task(self.emit(kind, r, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
