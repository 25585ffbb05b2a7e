"""The cluster agent: watch this cluster's desired state over NATS, reconcile replicas
through a runtime, keep the gateway's files current, report heartbeats and events.

Files under `state_dir` (atomic writes; see fleet_base/local_state.py):
- desired.json, routes.json, keys.json: the last DesiredState / RouteSet / KeySet seen on
  NATS (deletions included). Loaded FIRST on start, so a restart while NATS or the
  control plane is down reconciles and serves from them.
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

Longer than ~400 lines: one process's lifecycle (bucket watches, reconcile, heartbeats,
files, model commands) around shared state; its decisions live in `reconciler`,
`runtime/`, `local_state` and `fleet_base.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from pydantic import BaseModel, Field, ValidationError

from agent.adapters import ReplicaAdapters, spread
from agent.capacity import CapacitySignals, Placed
from agent.inventory import inventory
from agent.kv_relay import Followed, KvRelay
from agent.models import ModelPuller
from agent.reconciler import Action, ReplicaRecord, Restart, Start, Stop, backoff_delay, plan
from agent.replica_metrics import MetricsScraper
from agent.runtime import InvalidSpec, ReplicaHandle, Runtime, make_runtime
from agent.security.replica_auth import replica_headers
from fleet_base import api_keys, protocol
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import KeySet, LocalState, ReplicaSnapshot, RouteSet, atomic_write
from fleet_base.models import ModelCache
from fleet_base.nats_io import KvWatch, NatsLink, redact_url
from fleet_base.protocol import (
    DesiredState,
    Event,
    EventKind,
    Heartbeat,
    ModelCommand,
    PoolInventory,
    ReplicaLoad,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RoutingTable,
)
from fleet_base.security.tls import nats_tls, replica_verify
from fleet_base.wire import Rejected, decode

log = logging.getLogger("agent")

RECONCILE_INTERVAL_S = 0.5
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
            max_adapters=self.spec.max_adapters,
            adapter_uris={a.name: a.uri for a in self.spec.adapters},
        )


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
        self.clock = clock  # wall clock of replica timestamps and restart backoff
        self.cluster = config.cluster
        self.files = LocalState(config.state_dir)
        self.runtime = runtime or make_runtime(config)
        self.reconcile_interval_s = reconcile_interval_s
        self.link = NatsLink(
            config.nats_url,
            name=f"fleet-agent-{config.cluster}",
            tls=nats_tls(config.security, "agent", config.cluster),
            manage_jetstream=not config.security.enabled,  # with identities, the control plane's job
        )
        self.desired: DesiredState | None = None
        self.routes = RouteSet()
        self.keys = KeySet()
        self.replicas: dict[str, Replica] = {}
        self.pools: list[PoolInventory] = []
        self.capacity = CapacitySignals(hold_s=config.kubernetes.unschedulable_hold_s)
        self.scraper = MetricsScraper(verify=replica_verify(config.security))
        self.adapter_api = ReplicaAdapters(
            httpx.AsyncClient(timeout=10.0, verify=replica_verify(config.security)),
            replica_headers(config.security),
        )
        cache = ModelCache(config.model_cache_dir, config.model_cache_max_bytes)
        self.models = ModelPuller(cache, on_change=lambda: self._wake.set())
        # Pre-pull where replicas read the agent's cache: local processes, or a folder
        # configured as shared with them (a Kubernetes model volume the agent mounts too).
        self.prepull = self.runtime.name == "process" or config.model_cache_dir is not None
        # replicas' KV events -> fleet.v1.kvcache (the replica token and CA as the gateway uses)
        self.kv_relay = KvRelay(
            self.link,
            config.cluster,
            verify=replica_verify(config.security),
            headers=replica_headers(config.security),
        )
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._last_snapshot: str = ""
        self._last_snapshot_at = 0.0
        self._last_runtime: str = ""
        self._lockfile: IO[str] | None = None
        self._watches = [
            KvWatch(self.link, protocol.BUCKET_DESIRED, keys=self.cluster),
            KvWatch(self.link, protocol.BUCKET_ROUTES),
            KvWatch(self.link, protocol.BUCKET_KEYS),
        ]
        self._watches[0].subscribe(self._on_desired)
        self._watches[1].subscribe(self._on_route)
        self._watches[2].subscribe(self._on_key)
        self.link.on_connect(self._on_connect)
        self.link.respond(protocol.models_subject(self.cluster), self._on_models_command)

    @property
    def runtime_path(self) -> Path:
        return self.files.dir / "runtime.json"

    # ================================================================= lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain every replica and return."""
        self._acquire_lock()
        try:
            self._load_from_disk()
            await self._adopt()
            await self.reconcile_once()  # serve from disk before NATS (or nvidia-smi) answers
            self.pools = await asyncio.to_thread(inventory, self.config)
            log.info(
                "cluster %s: pools %s",
                self.cluster,
                ", ".join(f"{p.name}x{p.gpus_per_node}" for p in self.pools),
            )
            self.link.start()
            loops = [
                asyncio.create_task(self._reconcile_loop(), name="reconcile"),
                asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                asyncio.create_task(self._metrics_loop(), name="metrics"),
            ]
            await stop.wait()
            log.info("stopping: draining %d replicas", len(self.replicas))
            async with self._lock:  # never cut a reconcile pass in half (a started, unrecorded replica)
                for task in loops:
                    task.cancel()
            for task in loops:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for watch in self._watches:
                await watch.close()
            await self.kv_relay.close()
            if self.runtime.drain_on_exit:
                await self._drain_all()
            else:
                log.info("leaving %d replicas running for the next agent", len(self.replicas))
                self._write_snapshot(force=True)
                self._write_runtime()
            await self.models.close()
            await self.link.close()
        finally:
            await self.scraper.close()
            await self.adapter_api.http.aclose()
            await self.runtime.close()
            self._release_lock()

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

    def _load_from_disk(self) -> None:
        desired = self.files.load_desired()
        if desired is not None and desired.cluster == self.cluster:
            self.desired = desired
            log.info(
                "desired state from disk: generation %d, %d replicas",
                desired.generation,
                len(desired.replicas),
            )
        self.routes = self.files.load_routes()
        self.keys = self.files.load_keys()

    async def _adopt(self) -> None:
        try:
            saved = RuntimeFile.model_validate_json(self.runtime_path.read_bytes())
        except (FileNotFoundError, ValidationError, ValueError):
            saved = RuntimeFile(runtime=self.runtime.name)
        handles = [h for rid, h in saved.replicas.items() if rid not in self.replicas]
        try:  # replicas the runtime finds itself (kubernetes: pods by label), runtime.json lost
            known = {h.replica_id for h in handles}
            handles += [h for h in await self.runtime.discover() if h.replica_id not in known]
        except Exception as err:
            log.warning("could not list replicas to adopt: %s", err)
        if not handles:
            return
        adopted = await asyncio.gather(*(self.runtime.adopt(h) for h in handles), return_exceptions=True)
        for handle, ok in zip(handles, adopted):
            if ok is True:
                self.replicas[handle.replica_id] = Replica(
                    spec=handle.spec,
                    state=ReplicaState.starting,
                    handle=handle,
                    restarts=handle.restarts,
                    started_at=handle.started_at,
                )
            else:
                log.info("replica %s (pid %s) is gone; not adopted (%s)", handle.replica_id, handle.pid, ok)
        self._write_runtime()

    async def _drain_all(self) -> None:
        for r in list(self.replicas.values()):
            if r.replica_id not in self._stopping and r.state not in (ReplicaState.stopped,):
                self._begin_stop(r, "agent shutting down")
        if self._stopping:
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        self._write_snapshot(force=True)
        self._write_runtime()

    # ================================================================= NATS inputs

    async def _on_connect(self) -> None:
        log.info("connected to NATS at %s", redact_url(self.config.nats_url))
        await self._prune(protocol.BUCKET_ROUTES)
        await self._prune(protocol.BUCKET_KEYS)
        await self._publish_heartbeat()

    async def _prune(self, bucket: str) -> None:
        """Drop what disk holds and NATS no longer does (deleted while we were away)."""
        try:
            live = set(await self.link.kv_items(bucket))
        except Exception as err:
            log.warning("could not list %s: %s", bucket, err)
            return
        if bucket == protocol.BUCKET_ROUTES:
            gone = set(self.routes.routes) - live
            for key in gone:
                del self.routes.routes[key]
            if gone:
                self.files.save_routes(self.routes)
        else:
            gone = set(self.keys.keys) - live
            for key in gone:
                del self.keys.keys[key]
            if gone:
                self.files.save_keys(self.keys)
        if gone:
            log.info("%s: dropped %d entries deleted while disconnected", bucket, len(gone))

    @staticmethod
    def _parse(model: type[protocol.Message], key: str, value: bytes):
        try:  # a bucket entry: its key, not a subject, names what it is about
            return decode(model, key, value, subject_for=None)
        except Rejected as err:
            log.warning("ignoring %s %r (%s): %s", model.__name__, key, err.reason, err.detail)
            return None

    async def _on_desired(self, key: str, value: bytes | None) -> None:
        if value is None:
            generation = self.desired.generation if self.desired else 0
            desired = DesiredState(cluster=self.cluster, generation=generation, replicas=[])
            log.info("desired state deleted: running nothing")
        else:
            parsed = self._parse(DesiredState, key, value)
            if parsed is None:
                return
            desired = parsed
            if desired.cluster != self.cluster:
                log.warning("ignoring desired state for cluster %r under key %r", desired.cluster, key)
                return
            if self.desired is not None and desired.generation < self.desired.generation:
                # A replayed or forged older state: never act on it (a control plane that
                # lost its store still writes higher generations: control_plane.loops.publish).
                log.warning(
                    "ignoring desired state whose generation went back (%d -> %d)",
                    self.desired.generation,
                    desired.generation,
                )
                return
        self.files.save_desired(desired)
        self.desired = desired
        log.info("desired state: generation %d, %d replicas", desired.generation, len(desired.replicas))
        self._wake.set()

    async def _on_models_command(self, data: bytes) -> protocol.Message:
        command = self._parse(ModelCommand, "models", data)
        if command is None:
            return protocol.ModelCommandReply(ok=False, message="malformed model command")
        return await self.models.command(command)

    async def _on_route(self, key: str, value: bytes | None) -> None:
        if value is None:
            if self.routes.routes.pop(key, None) is None:
                return
        else:
            table = self._parse(RoutingTable, key, value)
            if table is None:
                return
            self.routes.routes[key] = table
        self.files.save_routes(self.routes)

    async def _on_key(self, key: str, value: bytes | None) -> None:
        if key == api_keys.KEYS_LEASE:
            if value is not None and self._parse(api_keys.KeyLease, key, value) is not None:
                self.files.save_key_lease(time.time())
            return
        if value is None:
            if self.keys.keys.pop(key, None) is None:
                return
        else:
            record = self._parse(ApiKeyRecord, key, value)
            if record is None:
                return
            self.keys.keys[key] = record
        self.files.save_keys(self.keys)

    # ================================================================= reconcile

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.reconcile_interval_s)
            self._wake.clear()
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile pass failed")

    async def reconcile_once(self) -> None:
        """Observe every replica, apply the policy's actions, persist what changed."""
        async with self._lock:
            await self._observe()
            now = self.clock()
            if self.desired is not None and self.prepull:  # on first placement, before a replica starts
                self.models.prefetch(
                    [s.model for s in self.desired.replicas] + [r.spec.model for r in self.replicas.values()]
                )
            actions = plan(self.desired, [r.record() for r in self.replicas.values()], now)
            for action in actions:
                await self._apply(action)
            for r in list(self.replicas.values()):  # replicas whose model has arrived (or failed)
                if r.pull_since is not None and r.handle is None and r.state == ReplicaState.pending:
                    pull = self.models.status(r.spec.model)
                    if pull is None or pull.state != "pulling":
                        await self._start(r, "replica_starting")
            self._write_runtime()
            self._write_snapshot()

    async def _observe(self) -> None:
        watched = [
            r
            for r in self.replicas.values()
            if r.handle is not None
            and r.replica_id not in self._stopping
            and r.state in (ReplicaState.starting, ReplicaState.ready, ReplicaState.draining)
        ]
        probes = await asyncio.gather(
            *(self.runtime.poll(r.handle) for r in watched if r.handle), return_exceptions=True
        )
        now = self.clock()
        for r, probe in zip(watched, probes):
            if isinstance(probe, BaseException):
                log.warning("polling replica %s failed: %r", r.replica_id, probe)
                continue
            if probe.unschedulable != r.unschedulable:
                r.unschedulable = probe.unschedulable
                if probe.unschedulable:
                    r.last_error = probe.error
                    message = f"{probe.error}; reported for re-placement"
                    await self._event("replica_unschedulable", r, message[-2000:])
            if probe.state == r.state:
                continue
            if probe.state == ReplicaState.failed:
                r.unschedulable = False
                if probe.preempted:  # the control plane records `replica_preempted` as it re-places
                    self.capacity.preempt(r.replica_id, now)
                # preempted: the control plane re-places it; restart here only if it does not
                wait = self.capacity.report_s if probe.preempted else 0.0
                await self._mark_failed(r, probe.error, now, min_delay_s=wait)
            elif probe.state == ReplicaState.ready:
                was_starting = r.state == ReplicaState.starting
                r.state = ReplicaState.ready
                r.ready_since = now  # last_error stays: why it last failed
                if was_starting and r.started_at is not None:  # this start's cold start
                    r.cold_start_s = round(now - r.started_at, 3)
                cold = f" after a {r.cold_start_s:.1f} s cold start" if r.cold_start_s is not None else ""
                await self._event("replica_ready", r, f"serving at {r.handle.url if r.handle else ''}{cold}")
            elif probe.state == ReplicaState.draining:
                r.state = ReplicaState.draining
            else:
                r.state = probe.state

    async def _mark_failed(
        self, r: Replica, error: str, now: float, retry: bool = True, min_delay_s: float = 0.0
    ) -> None:
        rc = self.config.replica
        stayed_ready = r.ready_since is not None and now - r.ready_since >= rc.restart_backoff_max_s
        r.streak = 1 if stayed_ready else r.streak + 1
        r.state = ReplicaState.failed
        r.handle = None
        r.ready_since = None
        r.failed_at = now
        r.last_error = error
        r.load = ReplicaLoad()
        self.scraper.forget(r.replica_id)
        if retry:
            delay = max(min_delay_s, backoff_delay(r.streak, rc.restart_backoff_s, rc.restart_backoff_max_s))
            r.next_restart_at = now + delay
            note = f"; restart in {delay:.1f} s"
        else:
            r.next_restart_at = None
            note = "; not restarting"
        log.warning("replica %s failed: %s%s", r.replica_id, error.splitlines()[0] if error else "", note)
        await self._event("replica_failed", r, (error + note)[-2000:])

    async def _apply(self, action: Action) -> None:
        if isinstance(action, Start):
            r = Replica(spec=action.spec)
            self.replicas[action.replica_id] = r
            await self._start(r, "replica_starting")
        elif isinstance(action, Restart):
            r = self.replicas[action.replica_id]
            r.restarts += 1
            r.spec = action.spec
            await self._start(r, "replica_restarted")
        elif isinstance(action, Stop):
            r = self.replicas.get(action.replica_id)
            if r is not None:
                self._begin_stop(r, action.reason)

    async def _start(self, r: Replica, kind: EventKind) -> None:
        now = self.clock()
        if kind == "replica_restarted":  # its backoff is over: a failed pull may be tried again
            self.models.retry(r.spec.model)
        if not await self._model_ready(r, now):
            return
        try:
            r.handle = await self.runtime.start(r.spec)
        except InvalidSpec as err:
            await self._mark_failed(r, f"invalid spec: {err}", now, retry=False)
            return
        except Exception as err:
            await self._mark_failed(r, f"could not start: {err}", now)
            return
        r.handle.restarts = r.restarts
        r.state = ReplicaState.starting
        r.started_at = now
        r.next_restart_at = None
        message = f"{r.spec.model} at {r.handle.url}"
        if kind == "replica_restarted":
            message = f"restart {r.restarts} after: {r.last_error.splitlines()[0] if r.last_error else '?'}"
        await self._event(kind, r, message)

    async def _model_ready(self, r: Replica, now: float) -> bool:
        """Whether the replica's model is in the node cache; else it waits (pending) for the
        pull, or fails with the pull's reason (a restart after the backoff pulls again)."""
        model = r.spec.model
        if not self.prepull or not self.models.needs_pull(model):
            r.startup = {"pull": 0.0}  # nothing to wait for: an alias or a local path
            return True
        pull = self.models.ensure(model)
        if pull.state == "pulling":
            if r.pull_since is None:
                r.pull_since, r.state = now, ReplicaState.pending
                await self._event(
                    "replica_starting", r, f"waiting for {model} to be pulled into the node cache"
                )
            return False
        waited = round(now - r.pull_since, 3) if r.pull_since is not None else 0.0
        r.pull_since = None
        if pull.state == "failed":
            await self._mark_failed(r, f"model pull failed: {pull.error}", now, retry=pull.retryable)
            return False
        r.startup = {"pull": waited}
        return True

    def _begin_stop(self, r: Replica, reason: str) -> None:
        rid = r.replica_id
        if rid in self._stopping:
            return
        log.info("replica %s: stopping (%s)", rid, reason)
        if r.handle is None:  # nothing running (failed): just forget it
            self._forget(r)
            self._emit_soon("replica_stopped", r, reason)
            return
        r.state = ReplicaState.draining
        self._stopping[rid] = asyncio.create_task(self._stop(r, reason), name=f"stop-{rid}")

    async def _stop(self, r: Replica, reason: str) -> None:
        handle = r.handle
        assert handle is not None
        try:
            code = await self.runtime.stop(handle, self.config.replica.drain_timeout_s)
        except Exception as err:
            log.exception("stopping replica %s failed", r.replica_id)
            code = None
            reason = f"{reason}; stop failed: {err}"
        r.state = ReplicaState.stopped
        r.handle = None
        self._forget(r)
        self._stopping.pop(r.replica_id, None)
        await self._event("replica_stopped", r, f"{reason}; exit code {code}")
        self._write_runtime()
        self._write_snapshot(force=True)
        self._wake.set()

    def _forget(self, r: Replica) -> None:
        if self.replicas.get(r.replica_id) is r:
            del self.replicas[r.replica_id]
        self.scraper.forget(r.replica_id)

    # ================================================================= outputs

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(
            cluster=self.cluster,
            replicas=[r.status() for r in sorted(self.replicas.values(), key=lambda r: r.replica_id)],
        )

    def _write_snapshot(self, force: bool = False) -> None:
        snap = self.snapshot()
        body = json.dumps([s.model_dump(mode="json") for s in snap.replicas], sort_keys=True)
        now = time.monotonic()
        if force or body != self._last_snapshot or now - self._last_snapshot_at >= SNAPSHOT_EVERY_S:
            self.files.save_replicas(snap)
            self._last_snapshot = body
            self._last_snapshot_at = now

    def _write_runtime(self) -> None:
        handles = {}
        for rid, r in sorted(self.replicas.items()):
            if r.handle is not None:
                r.handle.restarts = r.restarts
                handles[rid] = r.handle
        body = RuntimeFile(runtime=self.runtime.name, replicas=handles).model_dump_json(indent=1)
        if body != self._last_runtime:
            atomic_write(self.runtime_path, body.encode())
            self._last_runtime = body

    def heartbeat(self) -> Heartbeat:
        statuses = [r.status() for r in sorted(self.replicas.values(), key=lambda r: r.replica_id)]
        now = self.clock()
        self.capacity.observe(
            [
                Placed(
                    r.replica_id,
                    r.spec.pool,
                    r.spec.resources.gpu_count,
                    r.unschedulable and r.state == ReplicaState.starting,
                )
                for r in self.replicas.values()
                if r.state in (ReplicaState.starting, ReplicaState.ready, ReplicaState.draining)
            ],
            now,
        )
        return Heartbeat(
            cluster=self.cluster,
            provider=self.config.provider,
            region=self.config.region,
            coordinates=self.config.coordinates,
            gateway_url=self.config.gateway.url,
            pools=self.capacity.pools(self.pools, now),
            replicas=statuses,
            preempted=self.capacity.preempted(now),
            unschedulable=self.capacity.unschedulable,
            models=self.models.report(),
            desired_generation=self.desired.generation if self.desired is not None else -1,
            queue_depth=sum(s.load.waiting for s in statuses) + self._gateway_queue_depth(),
            tokens_per_s=sum(s.load.tokens_per_s for s in statuses),
        )

    def _gateway_queue_depth(self) -> int:
        """Requests queued at this cluster's gateway (its gateway.json)."""
        status = self.files.load_gateway()
        return status.queue_depth if status is not None else 0

    async def _publish_heartbeat(self) -> None:
        await self.link.publish(protocol.heartbeat_subject(self.cluster), self.heartbeat())

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._publish_heartbeat()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _metrics_loop(self) -> None:
        while True:
            ready = [
                r for r in self.replicas.values() if r.state == ReplicaState.ready and r.handle is not None
            ]
            self.kv_relay.sync(
                [Followed(r.replica_id, r.spec.deployment, r.handle.url) for r in ready if r.handle]
            )
            loads = await asyncio.gather(
                *(self.scraper.scrape(r.replica_id, r.handle.url) for r in ready if r.handle)
            )
            for r, load in zip(ready, loads):
                if load is not None and r.state == ReplicaState.ready:
                    r.load = load
                    r.startup.update(self.scraper.startup(r.replica_id))
            try:
                await self._sync_adapters(ready)
            except Exception:  # never let the metrics loop die
                log.exception("syncing LoRA adapters failed")
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s))

    async def _sync_adapters(self, ready: list[Replica]) -> None:
        """Apply each deployment's adapter catalog to its ready replicas: a new replica
        preloads its share (`agent.adapters.spread`), adapters the catalog dropped are
        unloaded, and what each holds is reported (heartbeats, replicas.json)."""
        wanted = {s.replica_id: s for s in self.desired.replicas} if self.desired else {}
        groups: dict[str, list[Replica]] = {}
        for r in ready:
            spec = wanted.get(r.replica_id)
            if spec is not None and spec.adapters != r.spec.adapters:  # applied live, no restart
                r.spec = r.spec.model_copy(update={"adapters": spec.adapters})
            if r.spec.max_adapters > 0 and r.handle is not None:
                groups.setdefault(r.spec.deployment, []).append(r)
        for deployment, reps in groups.items():
            catalog = {a.name: a.uri for a in reps[0].spec.adapters}
            room = reps[0].spec.max_adapters
            # Over every replica wanted here, ready or not, so the first one up does not
            # take the shares of those still starting.
            ids = [s.replica_id for s in wanted.values() if s.deployment == deployment]
            share = spread(list(catalog), ids or [r.replica_id for r in reps], room)
            for r in reps:
                assert r.handle is not None
                loaded = await self.adapter_api.loaded(r.handle.url)
                if loaded is None:
                    continue
                for name in [n for n in loaded if n not in catalog]:
                    if await self.adapter_api.unload(r.handle.url, name):
                        loaded.remove(name)
                if not r.adapters_seeded:
                    for name in share.get(r.replica_id, []):
                        if name not in loaded and len(loaded) < room:
                            if await self.adapter_api.load(r.handle.url, name, catalog[name]):
                                loaded.append(name)
                    r.adapters_seeded = True
                r.adapters = loaded

    async def _event(self, kind: EventKind, r: Replica, message: str = "") -> None:
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

    def _emit_soon(self, kind: EventKind, r: Replica, message: str) -> None:
        task = asyncio.get_running_loop().create_task(self._event(kind, r, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
