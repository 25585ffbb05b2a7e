"""The autoscale loop: every `autoscale_interval_s`, and at once when a gateway
asks to scale a deployment up from zero, each autoscaled deployment's demand (heartbeats
and gateway demand on NATS, summed over clusters) goes through its policy
(`control_plane.autoscale`); a changed count is written to `Deployment.replicas` (the
state that survives a restart) with a `scaled` event carrying the decision, a changed GPU
mix to `Deployment.variant_mix` (the placer's allowed GPU types), and the reconcile loop
is kicked so placement, desired state and routes follow.

Autoscaled: a current version with min_replicas < max_replicas. The policy's windows live
in memory; after a restart it does not scale down before one full window (the policy's
own rule), so a restart never drops replicas on a blind spot.

What clusters report is scoped first (`control_plane.report_scope`): a heartbeat counts
only for the replicas placed on its sender, demand only for deployments that exist (any
gateway may queue requests for any deployment: spillover and scale from zero), at most
`MAX_DEMANDS_PER_CLUSTER` entries per cluster. Each deployment is decided on its own: one
that fails is counted (`fleet_control_plane_loop_failures_total`) and the tick goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, deque

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from control_plane.autoscale.observe import observe, settings_of, within_residency
from control_plane.autoscale.policy import Decision, ScalerState, make_policy
from control_plane.autoscale.prediction_error import PredictionErrors
from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db.models import CapacityPool, Deployment, Event
from control_plane.inbox import Inbox
from control_plane.nats_loop import NatsLoop
from control_plane.report_scope import placed_replicas, scope_heartbeat
from control_plane.rollouts.store import active_for
from fleet_base import protocol

log = logging.getLogger(__name__)

# Deployments one cluster's gateway may have demand for at once (far above a fleet's count).
MAX_DEMANDS_PER_CLUSTER = 1024
RECENT_DECISIONS = 450  # per deployment: 15 min at the default 2 s interval


class AutoscaleLoop(NatsLoop):
    def __init__(
        self,
        ctx: ControlPlaneContext,
        interval_s: float | None = None,
        policy: str | None = None,
        inbox: Inbox | None = None,
    ) -> None:
        super().__init__(ctx)
        self._own_inbox = inbox is None  # alone (tests, tools): an inbox of its own
        self.inbox = inbox if inbox is not None else Inbox(ctx)
        self.inbox.receive("heartbeat", self._take_heartbeat)
        self.inbox.receive("demand", self._take_demand)
        self.interval_s = interval_s or ctx.settings.autoscale_interval_s
        self.policy_name = policy or ctx.settings.autoscale_policy
        self.policy = make_policy(self.policy_name)
        self.heartbeats: dict[str, protocol.Heartbeat] = {}
        self.demands: dict[tuple[str, str], protocol.Demand] = {}
        self._demand_count: Counter[str] = Counter()  # entries in `demands` per cluster
        self._scoped_at: dict[str, float] = {}  # cluster -> the heartbeat whose drops were counted
        self.states: dict[str, ScalerState] = {}
        self.decisions = 0
        self.last: dict[str, Decision] = {}
        self.errors = PredictionErrors()  # the decisions' forecasts against the load that came
        self.recent: dict[str, deque[tuple[float, Decision]]] = {}  # the console's charts
        self._wake = asyncio.Event()

    async def start(self) -> AutoscaleLoop:
        if self._own_inbox:
            await self.inbox.start()
        self._spawn(self._run(), name="cp-autoscale")
        return self

    async def stop(self) -> None:
        if self._own_inbox:
            await self.inbox.stop()
        await self._close()

    def _take_heartbeat(self, hb: protocol.Heartbeat) -> None:
        # our clock: a heartbeat dated ahead would never go stale after its cluster fell silent
        self.heartbeats[hb.cluster] = hb.model_copy(update={"sent_at": time.time()})

    @property
    def rejections(self) -> Rejections:
        return self.inbox.rejections

    def _take_demand(self, d: protocol.Demand) -> None:
        d = d.model_copy(update={"at": time.time()})  # our clock: agents' clocks may differ
        key = (d.cluster, d.deployment)
        if key not in self.demands:
            if self._demand_count[d.cluster] >= MAX_DEMANDS_PER_CLUSTER:
                self.rejections.refuse(
                    "demand", "budget", f"{d.cluster}: {MAX_DEMANDS_PER_CLUSTER} deployments"
                )
                return
            self._demand_count[d.cluster] += 1
        self.demands[key] = d
        if d.ready == 0:
            self._wake.set()  # scale from zero now, not at the next tick

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            await self._tick(self.tick, log, "autoscale tick")

    def tick(self, now: float) -> bool:
        """One decision per autoscaled deployment; True when a count changed."""
        changed = False
        with self.ctx.sessions() as session:
            rows = session.scalars(select(Deployment).options(selectinload(Deployment.versions))).all()
            pools = session.scalars(select(CapacityPool).options(selectinload(CapacityPool.cluster))).all()
            heartbeats = self._scoped_heartbeats(placed_replicas(session))
            names = {d.name for d in rows}
            for name in list(self.states):
                if name not in names:
                    del self.states[name]
            for kept in (self.last, self.recent):
                for name in list(kept):
                    if name not in names:
                        del kept[name]
            self.errors.keep_only(names)
            for d in rows:
                try:
                    changed = self._decide(session, d, heartbeats, pools, now) or changed
                except Exception as err:  # one deployment's bad numbers never stop the others
                    self.rejections.fail("autoscale", f"{d.name}: {type(err).__name__}: {err}")
            session.commit()
        cutoff = now - 60
        entries = list(self.demands.items())  # one copy: the event loop adds to it meanwhile
        unknown = [k for k, _ in entries if k[1] not in names]
        if unknown:
            self.rejections.refuse("demand", "unknown_deployment", f"{len(unknown)} entries", len(unknown))
        for key in unknown + [k for k, v in entries if v.at < cutoff and k[1] in names]:
            self.demands.pop(key, None)
        self._demand_count = Counter(cluster for cluster, _ in list(self.demands))
        return changed

    def _scoped_heartbeats(self, placed) -> list[protocol.Heartbeat]:
        """The latest heartbeats, each about its sender's placed replicas only; drops are
        counted once per heartbeat received."""
        out = []
        for hb in list(self.heartbeats.values()):
            scoped, dropped = scope_heartbeat(hb, placed)
            if dropped and self._scoped_at.get(hb.cluster) != hb.sent_at:
                self.rejections.refuse(
                    "heartbeat", "not_placed", f"{hb.cluster}: {dropped} replica(s)", dropped
                )
            self._scoped_at[hb.cluster] = hb.sent_at
            out.append(scoped)
        return out

    def _decide(self, session, d: Deployment, heartbeats, pools, now: float) -> bool:
        """One deployment's decision, written to its row; True when it changed."""
        version = d.version_row()
        if version is None or version.min_replicas >= version.max_replicas:
            self.states.pop(d.name, None)
            return False
        settings = settings_of(version, self.policy_name, within_residency(pools, d.residency))
        rollout = active_for(session, d.id)
        shadow = (
            frozenset({rollout.canary_version})
            if rollout is not None and rollout.phase == "shadowing"
            else frozenset()
        )
        obs = observe(d.name, heartbeats, self.demands, now=now, current=d.replicas, shadow_versions=shadow)
        state = self.states.setdefault(d.name, ScalerState())
        decision = self.policy.decide(settings, state, obs)
        self.last[d.name] = decision
        self.decisions += 1
        seen = {"requests_per_s": obs.requests_per_s, "prompt_tokens_per_s": obs.prompt_tokens_per_s}
        self.errors.record(d.name, now, decision.predicted, seen)
        self.recent.setdefault(d.name, deque(maxlen=RECENT_DECISIONS)).append((now, decision))
        changed = False
        if decision.mix != dict(d.variant_mix or {}):
            d.variant_mix = dict(decision.mix)  # the placer follows (reconcile kicked below)
            changed = True
        if decision.desired != d.replicas:
            log.info("autoscale %s: %d -> %d (%s)", d.name, d.replicas, decision.desired, decision.reason)
            d.replicas = decision.desired
            session.add(
                Event(
                    kind="scaled",
                    deployment=d.name,
                    message=f"{decision.current} -> {decision.desired}: {decision.reason} "
                    f"{json.dumps(decision.as_dict(), sort_keys=True)}",
                )
            )
            changed = True
        return changed


async def start_autoscale_loop(ctx: ControlPlaneContext, inbox: Inbox | None = None) -> AutoscaleLoop:
    return await AutoscaleLoop(ctx, inbox=inbox).start()
