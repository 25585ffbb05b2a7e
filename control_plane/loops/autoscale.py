"""The autoscale loop: every `autoscale_interval_s`, and at once when a gateway
asks to scale a deployment up from zero, each autoscaled deployment's demand (heartbeats
and gateway demand on NATS, summed over clusters) goes through its policy
(`control_plane.autoscale`); a changed count is written to `Deployment.replicas` (the
state that survives a restart) with a `scaled` event carrying the decision, a changed GPU
mix to `Deployment.variant_mix` (the placer's allowed GPU types), and the reconcile loop
is kicked so placement, desired state and routes follow.

Autoscaled: a current version with min_replicas < max_replicas. The policy's windows live
in memory; after a restart it does not scale down before one full window (the policy's
own rule), so a restart never drops replicas on a blind spot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from control_plane.autoscale.observe import observe, settings_of
from control_plane.autoscale.policy import Decision, ScalerState, make_policy
from control_plane.context import ControlPlaneContext
from control_plane.db.models import CapacityPool, Deployment, Event
from control_plane.inbox import Inbox
from control_plane.nats_loop import NatsLoop
from fleet_base import protocol

log = logging.getLogger(__name__)


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
        self.states: dict[str, ScalerState] = {}
        self.decisions = 0
        self.last: dict[str, Decision] = {}
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
        self.heartbeats[hb.cluster] = hb

    def _take_demand(self, d: protocol.Demand) -> None:
        d = d.model_copy(update={"at": time.time()})  # our clock: agents' clocks may differ
        self.demands[(d.cluster, d.deployment)] = d
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
        heartbeats = list(self.heartbeats.values())
        with self.ctx.sessions() as session:
            rows = session.scalars(select(Deployment).options(selectinload(Deployment.versions))).all()
            pools = session.scalars(select(CapacityPool)).all()
            names = {d.name for d in rows}
            for name in list(self.states):
                if name not in names:
                    del self.states[name]
            for d in rows:
                version = d.version_row()
                if version is None or version.min_replicas >= version.max_replicas:
                    self.states.pop(d.name, None)
                    continue
                settings = settings_of(version, self.policy_name, pools)
                obs = observe(d.name, heartbeats, self.demands, now=now, current=d.replicas)
                state = self.states.setdefault(d.name, ScalerState())
                decision = self.policy.decide(settings, state, obs)
                self.last[d.name] = decision
                self.decisions += 1
                if decision.mix != dict(d.variant_mix or {}):
                    d.variant_mix = dict(decision.mix)  # the placer follows (reconcile kicked below)
                    changed = True
                if decision.desired != d.replicas:
                    log.info(
                        "autoscale %s: %d -> %d (%s)", d.name, d.replicas, decision.desired, decision.reason
                    )
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
            session.commit()
        cutoff = now - 60
        for key in [k for k, v in self.demands.items() if v.at < cutoff]:
            del self.demands[key]
        return changed


async def start_autoscale_loop(ctx: ControlPlaneContext, inbox: Inbox | None = None) -> AutoscaleLoop:
    return await AutoscaleLoop(ctx, inbox=inbox).start()
