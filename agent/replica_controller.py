"""The replica controller: make this cluster's replicas what the desired state says,
through a runtime. Each pass observes every replica (`Runtime.poll`), applies the actions
of `agent.reconciler.plan` (start, restart after a crash backoff, stop), starts those whose
model has arrived in the node cache, and persists replicas.json and runtime.json.

Passes run under one lock, so shutdown never cuts one in half (a started, unrecorded
replica). Replicas left by a previous agent are adopted from runtime.json, or found by
the runtime itself (kubernetes: pods by label).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.capacity import CapacitySignals
from agent.models import ModelPuller
from agent.reconciler import Action, Restart, Start, Stop, backoff_delay, plan
from agent.replica import Replica, ReplicaEvents, ReplicaFiles
from agent.replica_metrics import MetricsScraper
from agent.runtime import InvalidSpec, Runtime
from fleet_base.cluster_config import ReplicaConfig
from fleet_base.local_state import ReplicaSnapshot
from fleet_base.protocol import DesiredState, EventKind, ReplicaLoad, ReplicaState

log = logging.getLogger("agent")

# A ready replica being stopped is first shown draining in replicas.json for this long (the
# gateway rereads it every 0.2 s), so requests stop going there before it refuses them.
UNROUTE_GRACE_S = 0.5


@dataclass(eq=False)
class ReplicaController:
    """The replicas this agent runs (`replicas`), reconciled towards `desired()`."""

    runtime: Runtime
    config: ReplicaConfig
    desired: Callable[[], DesiredState | None]
    files: ReplicaFiles
    events: ReplicaEvents
    models: ModelPuller
    # Pre-pull where replicas read the agent's cache: local processes, or a folder
    # configured as shared with them (a Kubernetes model volume the agent mounts too).
    prepull: bool
    scraper: MetricsScraper
    capacity: CapacitySignals
    clock: Callable[[], float]  # wall clock of replica timestamps and restart backoff
    interval_s: float
    replicas: dict[str, Replica] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _stopping: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        """Reconcile now rather than at the next interval."""
        self._wake.set()

    def snapshot(self) -> ReplicaSnapshot:
        return self.files.snapshot(self.replicas)

    def persist(self, force: bool = False) -> None:
        """Write replicas.json and runtime.json (replicas.json when changed, or `force`).
        A failed write (full disk) is reported by `LocalState.writes` and retried at the
        next pass: the replicas keep being reconciled meanwhile."""
        with contextlib.suppress(OSError):
            self.files.write_runtime(self.replicas)
        with contextlib.suppress(OSError):
            self.files.write_snapshot(self.replicas, force=force)

    async def adopt(self) -> None:
        """Take over the live replicas a previous agent left (runtime.json, or the runtime's
        own listing); the rest are started afresh by the next pass."""
        saved = self.files.saved_handles()
        handles = [h for rid, h in saved.items() if rid not in self.replicas]
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
        with contextlib.suppress(OSError):  # reported by LocalState.writes; the next pass retries
            self.files.write_runtime(self.replicas)

    async def drain(self) -> None:
        """Stop every replica (bounded by the drain timeout) and record them stopped."""
        for r in list(self.replicas.values()):
            if r.replica_id not in self._stopping and r.state not in (ReplicaState.stopped,):
                self._begin_stop(r, "agent shutting down")
        if self._stopping:
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        self.persist(force=True)

    async def run(self) -> None:
        """Reconcile every interval, or at once when woken."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile pass failed")

    async def reconcile_once(self) -> None:
        """Observe every replica, apply the policy's actions, persist what changed."""
        async with self.lock:
            await self._observe()
            now = self.clock()
            desired = self.desired()
            if desired is not None and self.prepull:  # on first placement, before a replica starts
                self.models.prefetch(
                    [s.model for s in desired.replicas] + [r.spec.model for r in self.replicas.values()]
                )
            actions = plan(desired, [r.record() for r in self.replicas.values()], now)
            for action in actions:
                await self._apply(action)
            for r in list(self.replicas.values()):  # replicas whose model has arrived (or failed)
                if r.pull_since is not None and r.handle is None and r.state == ReplicaState.pending:
                    pull = self.models.status(r.spec.model)
                    if pull is None or pull.state != "pulling":
                        await self._start(r, "replica_starting")
            self.persist()

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
                    await self.events.emit("replica_unschedulable", r, message[-2000:])
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
                await self.events.emit(
                    "replica_ready", r, f"serving at {r.handle.url if r.handle else ''}{cold}"
                )
            elif probe.state == ReplicaState.draining:
                r.state = ReplicaState.draining
            else:
                r.state = probe.state

    async def _mark_failed(
        self, r: Replica, error: str, now: float, retry: bool = True, min_delay_s: float = 0.0
    ) -> None:
        rc = self.config
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
        await self.events.emit("replica_failed", r, (error + note)[-2000:])

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
        await self.events.emit(kind, r, message)

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
                await self.events.emit(
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
            self.events.emit_soon("replica_stopped", r, reason)
            return
        was_ready = r.state == ReplicaState.ready
        r.state = ReplicaState.draining
        grace = UNROUTE_GRACE_S if was_ready else 0.0
        if grace:
            self.persist(force=True)
        self._stopping[rid] = asyncio.create_task(self._stop(r, reason, grace), name=f"stop-{rid}")

    async def _stop(self, r: Replica, reason: str, grace_s: float = 0.0) -> None:
        handle = r.handle
        assert handle is not None
        if grace_s:  # unrouted first (replicas.json says draining), then asked to drain
            await asyncio.sleep(grace_s)
        try:
            code = await self.runtime.stop(handle, self.config.drain_timeout_s)
        except Exception as err:
            log.exception("stopping replica %s failed", r.replica_id)
            code = None
            reason = f"{reason}; stop failed: {err}"
        r.state = ReplicaState.stopped
        r.handle = None
        self._forget(r)
        self._stopping.pop(r.replica_id, None)
        await self.events.emit("replica_stopped", r, f"{reason}; exit code {code}")
        self.persist(force=True)
        self._wake.set()

    def _forget(self, r: Replica) -> None:
        if self.replicas.get(r.replica_id) is r:
            del self.replicas[r.replica_id]
        self.scraper.forget(r.replica_id)
