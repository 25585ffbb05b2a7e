"""`fleetctl simulate` on a pipeline trace: each pipeline request is a sequence of per-step
requests, each step a deployment of its own (its profile, settings and replicas, scaled by
its own policy instance on its own demand: `des.Simulation`), the next step called
`hop_s` after the previous one finished (the step-to-step hop inside one cluster).

The same trace runs twice with the same policy: with each step scaled alone on its own
targets, and pipeline-aware (the end-to-end budget split over the steps by
`autoscale.pipeline_budget.split`, exactly as the live loop does, each step's decision
under its adjusted targets); and once on a fixed fleet, each step at the most replicas
either autoscaled run held (provisioning every step for its peak: the bound the autoscaled
runs are read against). Reported per step and end to end: latency p50/p90, the share of
requests within the budget, GPU-hours."""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from agent.sim.model import SimRequest
from control_plane.autoscale.pipeline_budget import BudgetMemory, split, step_floor, step_latency
from control_plane.autoscale.policy import AutoscaleSettings
from control_plane.simulate.des import Sample, Simulation
from control_plane.simulate.report import percentile
from control_plane.simulate.trace import PipelineTraceRequest
from fleet_base.pipelines import PipelineSpec
from fleet_base.profile import PerfProfile

DEFAULT_HOP_S = 0.010  # one hop inside a cluster


@dataclass(frozen=True)
class StepSetup:
    name: str
    profile: PerfProfile
    settings: AutoscaleSettings


@dataclass
class PipelineRun:
    label: str
    policy: str
    steps: list[StepSetup]
    step_latency: dict[str, list[float]]  # measured requests' time in each step (queue included)
    e2e: list[float]  # measured pipeline requests, arrival to the last step's finish
    requests: int  # measured (arrived after the warm-up)
    replica_seconds: dict[str, float]
    samples: dict[str, list[Sample]]
    budget_decisions: int = 0  # ticks at which some step was over its share
    unfinished: int = 0


class StepRow(BaseModel):
    p50_s: float
    p90_s: float
    replicas_max: int
    replicas_mean: float
    gpu_hours: float


class PipelineRow(BaseModel):
    label: str
    policy: str
    requests: int
    completed: int
    gpu_hours: float
    e2e_p50_s: float
    e2e_p90_s: float
    within_budget: float  # share of pipeline requests finished within slo_e2e_s
    budget_met: bool  # the e2e p90 within the budget
    budget_ticks: int
    steps: dict[str, StepRow]


class PipelineReport(BaseModel):
    trace: str
    pipeline: str
    slo_e2e_s: float
    hop_s: float
    policy: str
    rows: list[PipelineRow]
    wall_s: float = 0.0


class PipelineSimulation:
    """The steps' simulations on one clock; the pipeline-aware run splits the budget at each tick."""

    def __init__(
        self,
        trace: Sequence[PipelineTraceRequest],
        spec: PipelineSpec,
        steps: list[StepSetup],
        policy: str,
        *,
        budget_aware: bool,
        hop_s: float = DEFAULT_HOP_S,
        tick_s: float = 2.0,
        warmup_s: float = 0.0,
        label: str = "",
    ) -> None:
        self.trace, self.spec, self.steps, self.policy = trace, spec, steps, policy
        self.budget_aware = budget_aware and spec.slo_e2e_s is not None
        self.hop_s, self.tick_s, self.warmup_s = hop_s, tick_s, warmup_s
        self.label = label or policy
        self.sims = [
            Simulation([], s.profile, s.settings, policy, tick_s=tick_s,
                       initial_replicas=max(1, s.settings.min_replicas), warmup_s=warmup_s)
            for s in steps
        ]  # fmt: skip
        self.memory = BudgetMemory()
        self._hops: list[tuple[float, int, int, int]] = []  # (at, seq, step index, request index)
        self._seq = 0
        self._latency: list[list[float]] = [[] for _ in steps]
        self._e2e: dict[int, float] = {}
        self.budget_ticks = 0

    def _finished(self, k: int, req: SimRequest, now: float) -> None:
        done = req.finished_at if req.finished_at is not None else now
        i = req.rid
        if self.trace[i].at >= self.warmup_s:
            self._latency[k].append(done - req.arrival)
        if k + 1 < len(self.steps):
            self._seq += 1
            heapq.heappush(self._hops, (done + self.hop_s, self._seq, k + 1, i))
        else:
            self._e2e[i] = done - self.trace[i].at

    def _start(self, k: int, i: int, now: float, samples, decisions) -> None:
        cost = self.trace[i].steps[k]
        self.sims[k].arrive(
            SimRequest(i, cost.prompt_tokens, cost.output_tokens, now), now, samples[k], decisions
        )

    def _tick(self, now: float, samples: list[list[Sample]], decisions: list, arrivals: list[int]) -> None:
        seen = [sim.observe_now(now) for sim in self.sims]
        budgets = {}
        if self.budget_aware:
            latency = {s.name: step_latency(obs) for s, (obs, _) in zip(self.steps, seen, strict=True)}
            own = {s.name: s.settings.slo_ttft_s for s in self.steps}
            own_itl = {s.name: s.settings.slo_itl_s for s in self.steps}
            floors = {
                s.name: step_floor(sim.settings, sim.state, obs)
                for s, sim, (obs, _) in zip(self.steps, self.sims, seen, strict=True)
            }
            budgets = split([self.spec], latency, own, self.memory, now, own_itl, floors)
            if any(b.settings_update() for b in budgets.values()):
                self.budget_ticks += 1
        for k, (sim, (obs, ready)) in enumerate(zip(self.sims, seen, strict=True)):
            b = budgets.get(self.steps[k].name)
            settings = (
                sim.settings.model_copy(update=b.settings_update()) if b is not None and b.over else None
            )
            sim.decide_now(now, obs, ready, samples[k], decisions, arrivals[k], settings)
            arrivals[k] = 0

    def _busy(self, i: int) -> bool:
        if i < len(self.trace) or self._hops:
            return True
        return any(sim.pending or any(not r.model.idle() for r in sim.live) for sim in self.sims)

    def run(self) -> PipelineRun:
        n = len(self.steps)
        samples: list[list[Sample]] = [[] for _ in range(n)]
        decisions: list = []
        arrivals = [0] * n
        for k, sim in enumerate(self.sims):
            for _ in range(sim.initial):
                sim._add_replica(0.0, cold=False)
            sim.on_finished = self._callback(k)
        end_of_trace = self.trace[-1].at if self.trace else 0.0
        i, next_tick, now = 0, 0.0, 0.0
        while self._busy(i):
            t_arrival = self.trace[i].at if i < len(self.trace) else math.inf
            t_hop = self._hops[0][0] if self._hops else math.inf
            t_ready, ready_k = math.inf, -1
            t_replica, replica_at = math.inf, None
            for k, sim in enumerate(self.sims):
                if sim._ready_heap and sim._ready_heap[0][0] < t_ready:
                    t_ready, ready_k = sim._ready_heap[0][0], k
                for r in sim.live:
                    te = r.model.next_event_time()
                    if te < t_replica:
                        t_replica, replica_at = te, (sim, r)
            now = min(t_arrival, t_hop, t_ready, t_replica, next_tick)
            if now == next_tick:
                self._tick(now, samples, decisions, arrivals)
                next_tick += self.tick_s
                if now > end_of_trace + 3600:  # a stuck queue: give up rather than loop
                    break
            elif now == t_ready:
                sim = self.sims[ready_k]
                heapq.heappop(sim._ready_heap)
                sim._drain_queue(now)
            elif now == t_replica and replica_at is not None:
                sim, r = replica_at
                sim._on_events(r, r.model.advance(now), now)
            elif now == t_hop:
                _, _, k, j = heapq.heappop(self._hops)
                arrivals[k] += 1
                self._start(k, j, now, samples, decisions)
            else:
                arrivals[0] += 1
                self._start(0, i, now, samples, decisions)
                i += 1
        end = max(now, end_of_trace)
        w = self.warmup_s
        replica_s = {
            s.name: sum(
                max(0.0, (r.released if r.released is not None else end) - max(r.created, w))
                for r in sim.replicas
            )
            for s, sim in zip(self.steps, self.sims, strict=True)
        }
        measured = [j for j, r in enumerate(self.trace) if r.at >= w]
        return PipelineRun(
            self.label,
            self.policy,
            self.steps,
            {s.name: self._latency[k] for k, s in enumerate(self.steps)},
            [self._e2e[j] for j in measured if j in self._e2e],
            len(measured),
            replica_s,
            {s.name: [x for x in samples[k] if x.at >= w] for k, s in enumerate(self.steps)},
            self.budget_ticks,
            sum(1 for j in measured if j not in self._e2e),
        )

    def _callback(self, k: int) -> Callable[[SimRequest, float], None]:
        return lambda req, now: self._finished(k, req, now)


def summarize(run: PipelineRun, slo_e2e_s: float) -> PipelineRow:
    steps = {}
    gpu_h = 0.0
    for s in run.steps:
        lat = run.step_latency[s.name]
        reps = [x.replicas for x in run.samples[s.name]]
        g = run.replica_seconds[s.name] / 3600 * s.profile.gpus_per_replica
        gpu_h += g
        steps[s.name] = StepRow(
            p50_s=round(percentile(lat, 50), 4),
            p90_s=round(percentile(lat, 90), 4),
            replicas_max=max(reps, default=0),
            replicas_mean=round(sum(reps) / len(reps), 2) if reps else 0.0,
            gpu_hours=round(g, 3),
        )
    within = sum(1 for x in run.e2e if x <= slo_e2e_s)
    p90 = percentile(run.e2e, 90) if run.e2e else math.inf
    return PipelineRow(
        label=run.label,
        policy=run.policy,
        requests=run.requests,
        completed=len(run.e2e),
        gpu_hours=round(gpu_h, 3),
        e2e_p50_s=round(percentile(run.e2e, 50), 4),
        e2e_p90_s=round(p90, 4) if run.e2e else 0.0,
        within_budget=round(within / run.requests, 4) if run.requests else 0.0,
        budget_met=bool(run.e2e) and p90 <= slo_e2e_s and run.unfinished == 0,
        budget_ticks=run.budget_decisions,
        steps=steps,
    )


def trace_pipeline_name(stem: str) -> str:
    """A pipeline name from a trace file's stem ('RAG_trace' -> 'rag-trace'; 'trace' when
    nothing of it is left)."""
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower())
    name = re.sub(r"-+", "-", name)[:63].strip("-")
    return name or "trace"


def trace_pipeline(name: str, steps: Sequence[str], slo_e2e_s: float) -> PipelineSpec:
    """The pipeline a trace replays: each step its own deployment. ValueError, one line naming
    the field, when it is not a valid pipeline (step names, their count, repeats, the budget)."""
    try:
        return PipelineSpec.model_validate(
            {"name": name, "steps": [{"name": n, "deployment": n} for n in steps], "slo_e2e_s": slo_e2e_s}
        )
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "pipeline"
        bad = f" (got {first['input']!r})" if isinstance(first["input"], str | int | float) else ""
        raise ValueError(f"{where}: {first['msg']}{bad}") from None


def compare_pipeline(
    trace: Sequence[PipelineTraceRequest],
    steps: list[StepSetup],
    slo_e2e_s: float,
    *,
    pipeline: str = "pipeline",
    policy: str = "ours",
    hop_s: float = DEFAULT_HOP_S,
    tick_s: float = 2.0,
    warmup_s: float = 0.0,
    trace_name: str = "",
    on_run: Callable[[str], None] | None = None,
) -> PipelineReport:
    """The pipeline-aware run, each step alone, and the fixed fleet at the runs' peaks."""
    import time

    started = time.perf_counter()
    spec = trace_pipeline(pipeline, [s.name for s in steps], slo_e2e_s)
    runs: list[PipelineRun] = []
    for label, aware in (("pipeline-aware", True), ("steps alone", False)):
        if on_run is not None:
            on_run(label)
        runs.append(
            PipelineSimulation(trace, spec, steps, policy, budget_aware=aware, hop_s=hop_s,
                               tick_s=tick_s, warmup_s=warmup_s, label=label).run()
        )  # fmt: skip
    peak = {s.name: max(max((x.replicas for x in r.samples[s.name]), default=1) for r in runs) for s in steps}
    fixed = [
        StepSetup(s.name, s.profile, s.settings.model_copy(update={"min_replicas": peak[s.name],
                                                                   "max_replicas": peak[s.name]}))
        for s in steps
    ]  # fmt: skip
    if on_run is not None:
        on_run("fixed at peak")
    runs.append(
        PipelineSimulation(trace, spec, fixed, "static", budget_aware=False, hop_s=hop_s, tick_s=tick_s,
                           warmup_s=warmup_s, label="fixed at peak").run()
    )  # fmt: skip
    return PipelineReport(
        trace=trace_name,
        pipeline=pipeline,
        slo_e2e_s=slo_e2e_s,
        hop_s=hop_s,
        policy=policy,
        rows=[summarize(r, slo_e2e_s) for r in runs],
        wall_s=round(time.perf_counter() - started, 2),
    )
