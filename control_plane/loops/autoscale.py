"""The autoscale loop: every `autoscale_interval_s`, and at once when a gateway
asks to scale a deployment up from zero, each autoscaled deployment's demand (heartbeats
and gateway demand on NATS, summed over clusters; the shared batch backlog counted once)
goes through its policy (`control_plane.autoscale`); a changed count is written to
`Deployment.replicas` (the state that survives a restart) with a `scaled` event carrying
the decision, a changed GPU mix to `Deployment.variant_mix` (the placer's allowed GPU
types), and the reconcile loop is kicked so placement, desired state and routes follow.

Autoscaled: a current version with min_replicas < max_replicas. The policy's memory (its
windows, burst memory, cycles, trends) lives in memory and is stored per deployment at most
every `SAVE_S` (`control_plane.loops.autoscale_store`), in the tick's transaction; a new
leader (or a restarted control plane) resumes each deployment from it on its first
decision (`control_plane.autoscale.snapshot.resumed`: after a gap longer than the stable
window it does not scale down before one full window, the policy's own rule for a fresh
autoscaler); the cycles it has seen less of than the demand recorded in `usage_records`
are seeded from that (`control_plane.loops.autoscale_history`). A deployment is not decided while the loop is still blind to it: for up to
`LISTEN_S` after its first tick, until every cluster holding one of its replicas has been
heard from (a new leader's first ticks would otherwise take its replicas for idle).

What clusters report is scoped first (`control_plane.report_scope`): a heartbeat counts
only for the replicas placed on its sender, demand only for deployments that exist (any
gateway may queue requests for any deployment: spillover and scale from zero), at most
`MAX_DEMANDS_PER_CLUSTER` entries per cluster. Each deployment is decided on its own: one
that fails is counted (`fleet_control_plane_loop_failures_total`) and the tick goes on.

A deployment that is a step of a pipeline with an end-to-end budget keeps its own policy and
demand; the budget, split over the steps by what each needs at least (its least-load
latency; its measured latency without a profile: `control_plane.autoscale.pipeline_budget`),
tightens its TTFT target while it is over its share and the pipeline over its budget, and its
decision says so (reason, `predicted.pipeline`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, deque
from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from control_plane.autoscale.observe import (
    DEMAND_TTL_S,
    STALE_S,
    observe,
    settings_of,
    within_residency,
)
from control_plane.autoscale.pipeline_budget import BudgetMemory, StepBudget, split, step_floor, step_latency
from control_plane.autoscale.policy import AutoscaleSettings, Decision, Observation, ScalerState, make_policy
from control_plane.autoscale.prediction_error import PredictionErrors
from control_plane.autoscale.slo import SloPolicy
from control_plane.autoscale.snapshot import ScalerSnapshot, dump, dump_cycles, resumed
from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db.models import CapacityPool, Deployment, Event
from control_plane.inbox import Inbox
from control_plane.loops.autoscale_history import read_history
from control_plane.loops.autoscale_store import (
    CYCLES_SAVE_S,
    SAVE_S,
    forget_others,
    read_states,
    write_state,
)
from control_plane.nats_loop import NatsLoop
from control_plane.pipelines import load_pipelines
from control_plane.report_scope import placed_replicas, scope_heartbeat
from control_plane.rollouts.store import active_for
from fleet_base import protocol

log = logging.getLogger(__name__)

# Deployments one cluster's gateway may have demand for at once (far above a fleet's count).
MAX_DEMANDS_PER_CLUSTER = 1024
RECENT_DECISIONS = 450  # per deployment: 15 min at the default 2 s interval
LISTEN_S = STALE_S  # at most this long blind to a deployment after the first tick


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
        self.budget_memory = BudgetMemory()  # the pipelines' smoothed step shares
        self.budgets: dict[str, StepBudget] = {}  # deployment -> its pipeline budget, last tick
        self.errors = PredictionErrors()  # the decisions' forecasts against the load that came
        self.recent: dict[str, deque[tuple[float, Decision]]] = {}  # the console's charts
        self.save_every_s = SAVE_S
        self.resumed = 0  # deployments whose memory was read back from the database
        self.seeded = 0  # deployments whose cycles were seeded from the recorded demand
        self._stored: dict[int, tuple[str, ScalerSnapshot]] | None = None  # read on the first tick
        self._observed_at: dict[str, float] = {}  # deployment -> its state's last observation
        self._saved: dict[int, tuple[str, str | None]] = {}  # deployment id -> the memory last stored
        self._saved_at = self._cycles_saved_at = -float("inf")
        self._first_tick: float | None = None
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
        if self._first_tick is None:
            self._first_tick = now
        with self.ctx.sessions() as session:
            if self._stored is None:
                self._stored = read_states(session)
            rows = session.scalars(select(Deployment).options(selectinload(Deployment.versions))).all()
            pools = session.scalars(select(CapacityPool).options(selectinload(CapacityPool.cluster))).all()
            placed = placed_replicas(session)
            heartbeats = self._scoped_heartbeats(placed)
            blind = self._blind(placed, now)
            names = {d.name for d in rows}
            for name in list(self.states):
                if name not in names:
                    del self.states[name]
            for kept in (self.last, self.recent, self._observed_at):
                for name in list(kept):
                    if name not in names:
                        del kept[name]
            self.errors.keep_only(names)
            changed = self._decide_all(session, rows, blind, heartbeats, pools, now)
            saved = self._save(session, rows, now) if now - self._saved_at >= self.save_every_s else None
            session.commit()
        if saved is not None:  # stored: only now is it what the database holds
            self._saved, self._saved_at = saved, now
            if now - self._cycles_saved_at >= CYCLES_SAVE_S:
                self._cycles_saved_at = now
        cutoff = now - 60
        entries = list(self.demands.items())  # one copy: the event loop adds to it meanwhile
        unknown = [k for k, _ in entries if k[1] not in names]
        if unknown:
            self.rejections.refuse("demand", "unknown_deployment", f"{len(unknown)} entries", len(unknown))
        for key in unknown + [k for k, v in entries if v.at < cutoff and k[1] in names]:
            self.demands.pop(key, None)
        self._demand_count = Counter(cluster for cluster, _ in list(self.demands))
        return changed

    def _blind(self, placed, now: float) -> set[str]:
        """Deployments with a replica on a cluster not heard from since the first tick,
        while that was less than `LISTEN_S` ago (after it, a silent cluster's replicas are
        as missing as they would be to a loop that ran all along). One that gateways queue
        requests for is decided all the same: that demand is real, and to scale up is safe."""
        if self._first_tick is None or now - self._first_tick >= LISTEN_S:
            return set()
        heard = set(self.heartbeats)
        asked = {
            dep
            for (_, dep), d in list(self.demands.items())
            if (d.queued > 0 or d.batch_backlog > 0) and now - d.at <= DEMAND_TTL_S
        }
        return {name for cluster, name, _ in placed.values() if cluster not in heard and name not in asked}

    def _state(self, session, d: Deployment, window_s: float, now: float) -> ScalerState:
        """The deployment's memory: this loop's, else the one stored, else a fresh one; a
        memory this loop builds takes the cycles of the recorded demand it has not seen."""
        state = self.states.get(d.name)
        if state is None:
            stored = (self._stored or {}).pop(d.id, None)
            if stored is not None:
                state = resumed(stored[1], now, window_s)
                self.resumed += 1
                log.info("autoscale %s: resumed the stored memory of %.0fs ago", d.name, now - stored[1].at)
            else:
                state = ScalerState()
            self._seed_cycles(session, d, state, now)
            self.states[d.name] = state
        return state

    def _seed_cycles(self, session, d: Deployment, state: ScalerState, now: float) -> None:
        """The daily and weekly cycles of the deployment's recorded demand
        (`control_plane.loops.autoscale_history`), for a policy that keeps cycles."""
        if not isinstance(self.policy, SloPolicy):
            return
        try:
            created = d.created_at.timestamp() if d.created_at is not None else None
            with session.begin_nested():  # a failed read must not abort the tick's transaction
                history = read_history(session, d.name, now, created)
        except Exception as err:  # the deployment is decided all the same, learning live
            self.rejections.fail("autoscale", f"{d.name}: demand history: {type(err).__name__}: {err}")
            return
        taken = self.policy.seed_cycles(state, history, now) if history is not None else []
        if taken:
            self.seeded += 1
            log.info("autoscale %s: %s cycle(s) seeded from the recorded demand", d.name, ", ".join(taken))

    def _save(self, session, rows, now: float) -> dict[int, tuple[str, str | None]]:
        """Store each autoscaled deployment's memory that changed since it was last stored
        (its cycles only every `CYCLES_SAVE_S`); drop the rows of the others. Returns what
        the database holds once committed."""
        saved: dict[int, tuple[str, str | None]] = {}
        with_cycles = now - self._cycles_saved_at >= CYCLES_SAVE_S
        for d in rows:
            state, at = self.states.get(d.name), self._observed_at.get(d.name)
            if state is None or at is None:
                continue
            text, before = dump(state, at), self._saved.get(d.id)
            cycles = dump_cycles(state) if with_cycles or before is None else before[1]
            if before != (text, cycles):
                write_state(
                    session,
                    d.id,
                    self.policy_name,
                    text,
                    at,
                    cycles if before is None or cycles != before[1] else None,
                )
            saved[d.id] = (text, cycles)
        waiting = set(self._stored or {}) & {d.id for d in rows}  # not decided yet: kept as stored
        forget_others(session, set(saved) | waiting)
        return saved

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

    def _decide_all(self, session, rows, blind: set[str], heartbeats, pools, now: float) -> bool:
        """Every deployment's observation first, then the pipelines' budgets over them, then
        each deployment's decision."""
        changed = False
        inputs: dict[str, tuple[Deployment, AutoscaleSettings, Observation]] = {}
        for d in rows:
            if d.name in blind:
                continue
            try:
                seen = self._inputs(session, d, heartbeats, pools, now)
            except Exception as err:  # one deployment's bad numbers never stop the others
                self.rejections.fail("autoscale", f"{d.name}: {type(err).__name__}: {err}")
                continue
            if seen is not None:
                inputs[d.name] = (d, *seen)
        budgets = self._budgets(session, inputs, now)
        for name, (d, settings, obs) in inputs.items():
            try:
                changed = self._decide(session, d, settings, obs, budgets.get(name), now) or changed
            except Exception as err:
                self.rejections.fail("autoscale", f"{d.name}: {type(err).__name__}: {err}")
        return changed

    def _inputs(
        self, session, d: Deployment, heartbeats, pools, now: float
    ) -> tuple[AutoscaleSettings, Observation] | None:
        """A deployment's settings and this tick's observation (None: not autoscaled)."""
        version = d.version_row()
        if version is None or version.min_replicas >= version.max_replicas:
            self.states.pop(d.name, None)
            self._observed_at.pop(d.name, None)
            if self._stored:
                self._stored.pop(d.id, None)
            return None
        settings = settings_of(version, self.policy_name, within_residency(pools, d.residency))
        rollout = active_for(session, d.id)
        shadow = (
            frozenset({rollout.canary_version})
            if rollout is not None and rollout.phase == "shadowing"
            else frozenset()
        )
        obs = observe(d.name, heartbeats, self.demands, now=now, current=d.replicas, shadow_versions=shadow)
        return settings, obs

    def _budgets(self, session, inputs, now: float) -> dict[str, StepBudget]:
        """The pipelines' end-to-end budgets over this tick's measured step latencies."""
        try:
            pipelines = [p for p in load_pipelines(session) if p.slo_e2e_s is not None]
        except Exception as err:  # the steps are still decided, each on its own target
            self.rejections.fail("autoscale", f"pipelines: {type(err).__name__}: {err}")
            return {}
        if not pipelines:
            self.budget_memory.keep(())
            self.budgets = {}
            return {}
        latency = {name: step_latency(obs) for name, (_, _, obs) in inputs.items()}
        own = {name: settings.slo_ttft_s for name, (_, settings, _) in inputs.items()}
        own_itl = {name: settings.slo_itl_s for name, (_, settings, _) in inputs.items()}
        floors = {
            name: step_floor(settings, self.states.get(name), obs)
            for name, (_, settings, obs) in inputs.items()
        }
        self.budgets = split(pipelines, latency, own, self.budget_memory, now, own_itl, floors)
        return self.budgets

    def _decide(
        self,
        session,
        d: Deployment,
        settings: AutoscaleSettings,
        obs: Observation,
        budget: StepBudget | None,
        now: float,
    ) -> bool:
        """One deployment's decision (its targets tightened while its pipeline's budget
        says it is over its share), written to its row; True when it changed."""
        if budget is not None and budget.over:
            settings = settings.model_copy(update=budget.settings_update())
        state = self._state(session, d, settings.stable_window_s or 60.0, now)
        decision = self.policy.decide(settings, state, obs)
        if budget is not None:
            decision = replace(
                decision,
                reason=f"{decision.reason}; {budget.reason}" if budget.over else decision.reason,
                predicted={**decision.predicted, "pipeline": budget.as_dict()},
            )
        self._observed_at[d.name] = now
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
