"""The rollout loop: every tick, each active rollout's state, its canary's ready
replicas and the gateway telemetry of its window go through `policy.decide`; a changed
state is stored (conditionally on the row's revision) with an event, and reconcile is
kicked so placement and routes follow. Usage records arrive on `fleet.v1.usage.*`
(core NATS); after a restart or a change of leader, the open windows are first replayed
from the FLEET_USAGE stream (each record once, by its id, should it also arrive live), so
a resumed step is judged on its whole window, from its stored start. Where the replay did
not cover a window (it failed, or NATS was not there at the start), that step's window
starts again where this loop's evidence begins and is stored so: a step is never passed
on less than a whole window of evidence. A record counts only from a
cluster that hosts a replica of the version it names (`control_plane.report_scope`): a
cluster without the canary can neither force nor block its rollback."""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import func, select

from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db.models import Event, ReplicaAssignment, Rollout
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.nats_loop import Handler, NatsLoop
from control_plane.report_scope import hosting, placed_replicas
from control_plane.rollouts.capacity_status import capacity_numbers, with_capacity
from control_plane.rollouts.policy import Decision, Observation, RolloutParams, decide
from control_plane.rollouts.shadow import Comparison
from control_plane.rollouts.store import (
    active_rows,
    numbers_text,
    params_of,
    record,
    state_of,
    write_state,
)
from control_plane.rollouts.telemetry import UsageWindows
from control_plane.stream_replay import replay_usage, start_time
from fleet_base import protocol
from fleet_base.wire import Rejected, decode_usage

log = logging.getLogger(__name__)

TICK_S = 0.25
LAST_EVERY_S = 1.0  # how often a waiting rollout's live numbers are stored for `status`


class RolloutLoop(NatsLoop):
    def __init__(
        self,
        ctx: ControlPlaneContext,
        windows: UsageWindows | None = None,
        tick_s: float = TICK_S,
        rejections: Rejections | None = None,
    ) -> None:
        super().__init__(ctx)
        self.windows = windows or UsageWindows()
        self.rejections = rejections if rejections is not None else Rejections()
        # (cluster, deployment, version) of every placed replica, re-read every tick
        self.hosting: frozenset[tuple[str, str, int]] = frozenset()
        self.tick_s = tick_s
        self.started_at = time.time()
        self.decisions = 0
        self._seen: set[int] = set()
        self._last_written: dict[int, float] = {}
        self.replayed: int | None = None  # records replayed from the stream (None: not yet)
        self.replayed_since: float | None = None  # windows are whole from here on

    async def start(self) -> RolloutLoop:
        await self._listen()
        self._spawn(self._run(), name="cp-rollouts")
        return self

    async def stop(self) -> None:
        await self._close()

    def _subscriptions(self) -> list[tuple[str, Handler]]:
        return [(protocol.USAGE_WILDCARD, self._on_usage)]

    async def _on_subscribed(self) -> None:
        self.hosting = await asyncio.to_thread(self._read_hosting)
        if self.replayed is None:
            try:
                self.replayed = await self._replay(until=time.time())
            except Exception as err:  # the live feed still works; windows count from now
                log.warning("replaying usage for open rollout windows failed: %s", err)

    async def _replay(self, until: float) -> int:
        """Usage records of open windows from the FLEET_USAGE stream, up to `until` (the
        live subscription has everything after it)."""
        link = self.ctx.nats
        since, open_deployments = await asyncio.to_thread(self._open_since)
        self.windows.watch(open_deployments)  # before the first tick: replayed windows are kept whole
        if since is None or link is None or link.js is None:
            return 0
        oldest_kept = (await link.js.stream_info(protocol.STREAM_USAGE)).state.first_seq
        count, whole_since, first = 0, since, True
        async for usage, metadata in replay_usage(link.js, since):
            if first:
                whole_since = max(since, _head_lost_until(metadata, oldest_kept))
                first = False
            if usage is not None and since <= usage.at < until and self._hosted(usage):
                self.windows.add(usage, at=usage.at)
                count += 1
        self.replayed_since = whole_since
        log.info("replayed %d usage records since %s for open rollout windows", count, start_time(since))
        if whole_since > since:
            log.warning(
                "the usage stream no longer holds records before %.0f: windows restart there", whole_since
            )
        return count

    def _open_since(self) -> tuple[float | None, frozenset[str]]:
        """When the oldest open window began, and the deployments with an open rollout."""
        with self.ctx.sessions() as session:
            rows = active_rows(session)
        starts = [row.window_started_at for row, _, _ in rows if row.window_started_at is not None]
        return (min(starts) if starts else None), frozenset(name for _, name, _ in rows)

    async def _on_usage(self, msg) -> None:
        try:
            usage = decode_usage(msg.subject, msg.data)
        except Rejected:  # counted by the durable usage store, which reads it too
            return
        if self._hosted(usage):
            self.windows.add(usage)

    def _hosted(self, usage: protocol.UsageRecord) -> bool:
        """Whether the record's cluster hosts a replica of the version it names (a record
        naming no version says nothing about one and is left out)."""
        if usage.version is None:
            return False
        if (usage.cluster, usage.deployment, usage.version) in self.hosting:
            return True
        self.rejections.refuse(
            "rollout_sample",
            "not_hosted",
            f"{usage.cluster} hosts no {usage.deployment[:63]} v{usage.version}",
        )
        return False

    def _read_hosting(self) -> frozenset[tuple[str, str, int]]:
        with self.ctx.sessions() as session:
            return hosting(placed_replicas(session))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            await self._tick(self.tick, log, "rollout tick")

    # ----------------------------------------------------------------- one pass (sync, in a thread)

    def tick(self, now: float) -> bool:
        """Decide every active rollout once; True when any state changed."""
        changed = False
        with self.ctx.sessions() as session:
            self.hosting = hosting(placed_replicas(session))
            rows = active_rows(session)
            self.windows.watch(frozenset(name for _, name, _ in rows))
            capacity = _capacity(session) if rows else {}
            for row, name, replicas in rows:
                if row.id not in self._seen:
                    self._seen.add(row.id)
                    if row.created_at.timestamp() < self.started_at - 1:
                        session.add(
                            Event(
                                kind="rollout_resumed",
                                deployment=name,
                                message=(
                                    f"{name} v{row.baseline_version}->v{row.canary_version}: resumed in phase "
                                    f"{row.phase} at step {row.step + 1}"
                                ),
                            )
                        )
                decision, shadow = self._decide(session, row, name, replicas, now)
                decision = with_capacity(decision, capacity.get(name))
                stats = shadow.as_json() if shadow is not None else None
                if decision.changed:
                    if write_state(session, row, decision.state, decision.numbers, stats):
                        record(session, name, row, decision)
                        self.decisions += 1
                        changed = True
                        log.info(
                            "rollout %s: %s [%s]", name, decision.message, numbers_text(decision.numbers)
                        )
                elif now - self._last_written.get(row.id, 0.0) >= LAST_EVERY_S:
                    numbers = {**decision.numbers, "status": decision.message}
                    if write_state(session, row, decision.state, numbers, stats):
                        self._last_written[row.id] = now
            session.commit()
        return changed

    def evidence_since(self) -> float:
        """Since when this loop holds every usage record: its start, or where the replay of
        the stream began (the oldest open window) when it replayed."""
        return self.started_at if self.replayed_since is None else min(self.started_at, self.replayed_since)

    def _decide(
        self, session, row: Rollout, name: str, replicas: int, now: float
    ) -> tuple[Decision, Comparison | None]:
        """The policy's decision, and the shadow comparison while the shadow phase runs."""
        params: RolloutParams = params_of(row)
        state = state_of(row)
        ready = session.scalar(
            select(func.count())
            .select_from(ReplicaAssignment)
            .where(
                ReplicaAssignment.deployment_id == row.deployment_id,
                ReplicaAssignment.version == row.canary_version,
                ReplicaAssignment.state == protocol.ReplicaState.ready.value,
            )
        )
        since = state.window_started_at or now
        floor = self.evidence_since()
        if state.window_started_at is not None and floor > state.window_started_at:
            # Part of the window is gone (not replayed): the step's window starts again where
            # the evidence does, and is stored so; the step is judged on a whole window.
            log.warning(
                "rollout %s: usage before %.0f was not replayed; step %d's window restarts there",
                name, floor, state.step + 1,
            )  # fmt: skip
            state = state.model_copy(update={"window_started_at": floor})
            since = floor
        shadow = None
        if (
            state.phase == "shadowing"
            and params.shadow_share is not None
            and state.window_started_at is not None
        ):
            shadow = self.windows.shadow(name, row.canary_version, since, params.shadow_share)
        obs = Observation(
            now=now,
            replicas=replicas,
            canary_ready=int(ready or 0),
            canary=self.windows.stats(name, row.canary_version, since),
            baseline=self.windows.stats(name, row.baseline_version, since),
            shadow=shadow or Comparison(),
        )
        return decide(params, state, obs), shadow


def _head_lost_until(metadata, oldest_kept: int) -> float:
    """Where the replay's evidence begins when the stream dropped messages (it discards the
    oldest when full): the replay starting at the oldest message the stream still holds
    may have lost what came before it, so what it holds begins at that message. 0.0: the
    replay began inside what the stream holds, nothing before it was lost."""
    if oldest_kept <= 1 or int(metadata.sequence.stream) != oldest_kept:
        return 0.0
    return metadata.timestamp.timestamp()


def _capacity(session) -> dict:
    """Surge/replace numbers by deployment."""
    return capacity_numbers(read_snapshot(session))


async def start_rollout_loop(ctx: ControlPlaneContext, rejections: Rejections | None = None) -> RolloutLoop:
    return await RolloutLoop(ctx, rejections=rejections).start()
