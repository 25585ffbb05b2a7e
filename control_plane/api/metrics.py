"""`GET /metrics`: the control plane's Prometheus text, no auth (like the gateways' and
replicas'). Every gauge is computed from the database at scrape time, so it cannot drift
from what the API serves; the reconcile counters come from the running loops, if any.
A dedicated registry: no process or Python collectors, nothing from other modules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import get_args

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.api.views import used_gpus
from control_plane.autoscale.policy import Decision
from control_plane.autoscale.prediction_error import SIGNALS, PredictionErrors
from control_plane.cost.budget_metrics import budget_metrics
from control_plane.cost.metrics import CostCollector
from control_plane.counters import ReconcileStats, Rejections
from control_plane.db.models import CapacityPool, Cluster, Deployment, ReplicaAssignment, Rollout
from control_plane.nodes.metrics import node_metrics
from control_plane.placement.hold import UNREACHABLE
from control_plane.rollouts.policy import Phase
from control_plane.scheduled import ScheduledJobs
from control_plane.scheduled.metrics import scheduled_metrics
from fleet_base.domain import ClusterStatus
from fleet_base.listener import RefusalCollector
from fleet_base.protocol import ReplicaState

PREFIX = "fleet_control_plane_"
READY = ReplicaState.ready.value


class ControlPlaneCollector(Collector):
    """Reads the database on every scrape; `stats()` gives the loops' reconcile stats."""

    def __init__(
        self,
        sessions: Callable[[], sessionmaker[Session]],
        stats: Callable[[], ReconcileStats | None],
        rejections: Callable[[], Rejections | None] = lambda: None,
        decisions: Callable[[], Mapping[str, Decision] | None] = lambda: None,
        errors: Callable[[], PredictionErrors | None] = lambda: None,
        scheduled: Callable[[], ScheduledJobs | None] = lambda: None,
    ) -> None:
        self.sessions = sessions
        self.stats = stats
        self.rejections = rejections
        self.decisions = decisions
        self.errors = errors
        self.scheduled = scheduled

    def collect(self) -> Iterator[Metric]:
        with self.sessions()() as session:
            yield from _database_metrics(session)
        stats = self.stats()
        if stats is not None:
            yield from _reconcile_metrics(stats)
        yield from autoscale_metrics(self.decisions() or {})
        yield from prediction_error_metrics(self.errors())
        yield from scheduled_metrics(self.scheduled())
        c = CounterMetricFamily(
            PREFIX + "rejected_messages",
            "NATS messages refused and skipped (malformed, out of bounds, refused by the database).",
            labels=["subject", "reason"],
        )
        rejections = self.rejections()
        snapshot = rejections.snapshot() if rejections else {}
        for (subject, reason), n in sorted(snapshot.items()):
            c.add_metric([subject, reason], n)
        yield c
        refused = CounterMetricFamily(
            PREFIX + "reports_refused",
            "Reports that decode but speak beyond their sender (a key, deployment, replica or "
            "time window it has no say in), dropped.",
            labels=["kind", "reason"],
        )
        for (kind, reason), n in sorted((rejections.refusal_snapshot() if rejections else {}).items()):
            refused.add_metric([kind, reason], n)
        yield refused
        failures = CounterMetricFamily(
            PREFIX + "loop_failures",
            "Units of a control loop's work (one deployment's decision) that failed and were skipped.",
            labels=["loop"],
        )
        for loop, n in sorted((rejections.failure_snapshot() if rejections else {}).items()):
            failures.add_metric([loop], n)
        yield failures


# The SLO autoscaler's predictions (`Decision.predicted`), per deployment: gauge name,
# the key in `predicted`, help.
AUTOSCALE_GAUGES = (
    ("cold_start_seconds", "cold_start_s", "Cold start the autoscaler plans with (measured by agents, else the profile's)."),
    ("scale_down_delay_seconds", "scale_down_delay_s", "Scale-down delay derived from the cold start (or the deployment's own)."),
    ("burst_replicas", "burst_need", "Replicas the burst memory would hold through a lull (the smallest fixed fleet its windows needed)."),
    ("burst_held_replicas", "burst_held", "Replicas held for the bursts now (0: not holding)."),
    ("burst_hold_seconds", "burst_hold_s", "How long after a burst its capacity is held (from the cold start and the gaps seen)."),
    ("burst_since_seconds", "burst_since_s", "Seconds since the last burst ended."),
    ("burst_gap_seconds", "burst_gap_s", "The gap between bursts that all but the miss budget fall within (fitted tail)."),
    ("bursts", "bursts", "Bursts in the memory."),
    ("burst_prompt_tokens_per_second", "burst_prompt_tokens_per_s", "Prompt tokens/s of the largest remembered burst's busiest 10 s."),
    ("seasonal_prompt_tokens_per_second", "seasonal_prompt_tokens_per_s", "Prompt tokens/s the daily or weekly cycle expects one cold start ahead."),
    ("predicted_requests_per_second", "requests_per_s", "Requests/s the decision sized for (one cold start ahead)."),
    ("predicted_prompt_tokens_per_second", "prompt_tokens_per_s", "Prompt tokens/s the decision sized for."),
    ("predicted_ttft_seconds", "ttft_s", "Mean TTFT the capacity model predicts at the desired count."),
    ("predicted_attainment", "attainment", "Share of requests the model predicts within the TTFT target."),
)  # fmt: skip
AUTOSCALE_PREFIX = "fleet_autoscale_"


def autoscale_metrics(decisions: Mapping[str, Decision]) -> Iterator[Metric]:
    """The last decision's predictions per deployment; a deployment without the figure (no
    profile, no burst seen) has no sample."""
    for name, key, doc in AUTOSCALE_GAUGES:
        g = GaugeMetricFamily(AUTOSCALE_PREFIX + name, doc, labels=["deployment"])
        for deployment, d in sorted(decisions.items()):
            value = d.predicted.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            g.add_metric([deployment], float(value))
        yield g


# The forecasts checked against the load that came (`PredictionErrors`), per deployment and
# signal (prompt_tokens_per_s, requests_per_s): gauge name, help.
PREDICTION_ERROR_GAUGES = (
    ("prediction_predicted", "The last forecast that came due (made one horizon earlier), in the signal's unit."),
    ("prediction_observed", "The load observed when that forecast came due."),
    ("prediction_error", "Predicted minus observed, in the signal's unit (positive: over-predicted)."),
    ("prediction_error_ratio", "(Predicted - observed) / observed (no sample when nothing was observed)."),
    ("prediction_mape", "Smoothed absolute percentage error: decaying sum |error| / sum observed (10 min half-life)."),
)  # fmt: skip


def prediction_error_metrics(errors: PredictionErrors | None) -> Iterator[Metric]:
    """The last matched forecast per deployment and signal, its error and the smoothed error;
    no sample before a forecast has come due."""
    gauges = {
        name: GaugeMetricFamily(AUTOSCALE_PREFIX + name, doc, labels=["deployment", "signal"])
        for name, doc in PREDICTION_ERROR_GAUGES
    }
    for deployment, d in sorted((errors.deployments if errors is not None else {}).items()):
        for signal in SIGNALS:
            o = d.last.get(signal)
            if o is None:
                continue
            labels = [deployment, signal]
            gauges["prediction_predicted"].add_metric(labels, o.predicted)
            gauges["prediction_observed"].add_metric(labels, o.observed)
            gauges["prediction_error"].add_metric(labels, o.error)
            if o.ratio is not None:
                gauges["prediction_error_ratio"].add_metric(labels, o.ratio)
            mape = d.mape(signal)
            if mape is not None:
                gauges["prediction_mape"].add_metric(labels, mape)
    yield from gauges.values()


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _database_metrics(session: Session) -> Iterator[Metric]:
    clusters = list(session.execute(select(Cluster.id, Cluster.region, Cluster.status)))
    by_status = Counter(status for _, _, status in clusters)
    g = _gauge("clusters", "Clusters by status.", ["status"])
    for status in sorted({s.value for s in ClusterStatus} | set(by_status)):
        g.add_metric([status], by_status.get(status, 0))
    yield g

    yield from _state_write_metrics(session)

    deployments = list(session.execute(select(Deployment.id, Deployment.name, Deployment.replicas)))
    yield GaugeMetricFamily(PREFIX + "deployments", "Deployments.", value=len(deployments))

    states: dict[int, Counter] = {}
    per_cluster: Counter = Counter()
    rows = session.execute(
        select(
            ReplicaAssignment.deployment_id,
            ReplicaAssignment.cluster_id,
            ReplicaAssignment.state,
            func.count(),
        ).group_by(ReplicaAssignment.deployment_id, ReplicaAssignment.cluster_id, ReplicaAssignment.state)
    )
    for dep_id, cluster_id, state, count in rows:
        states.setdefault(dep_id, Counter())[state] += count
        per_cluster[(cluster_id, state)] += count
    desired = _gauge(
        "desired_replicas", "Replicas each deployment asks for (autoscaler included).", ["deployment"]
    )
    ready = _gauge("ready_replicas", "Replicas of each deployment that are ready.", ["deployment"])
    assigned = _gauge("assigned_replicas", "Replicas placed for each deployment, any state.", ["deployment"])
    for dep_id, name, replicas in sorted(deployments, key=lambda d: d[1]):
        desired.add_metric([name], replicas)
        ready.add_metric([name], states.get(dep_id, Counter()).get(READY, 0))
        assigned.add_metric([name], sum(states.get(dep_id, Counter()).values()))
    yield from (desired, ready, assigned)

    mix = _gauge(
        "variant_replicas",
        "Replicas per GPU type the placer is given (the autoscaler's cheapest mix; 'any': no mix).",
        ["deployment", "gpu_model"],
    )
    rows = session.execute(
        select(Deployment.name, Deployment.replicas, Deployment.variant_mix).order_by(Deployment.name)
    )
    for name, replicas, variant_mix in rows:
        for gpu, count in sorted((variant_mix or {}).items()) or [("any", replicas)]:
            mix.add_metric([name, str(gpu)], float(count))
    yield mix

    regions = {cid: region for cid, region, _ in clusters}
    g = _gauge("replicas", "Replica assignments by cluster and state.", ["cluster", "region", "state"])
    for cluster_id, _, _ in sorted(clusters):
        for state in (*(s.value for s in ReplicaState), UNREACHABLE):
            g.add_metric([cluster_id, regions[cluster_id], state], per_cluster.get((cluster_id, state), 0))
    yield g

    used = used_gpus(session)
    total_g = _gauge(
        "pool_gpus",
        "GPUs of capacity pools (nodes x GPUs per node).",
        ["cluster", "pool", "tier", "gpu_model"],
    )
    used_g = _gauge(
        "pool_gpus_used",
        "GPUs of capacity pools held by replica assignments.",
        ["cluster", "pool", "tier", "gpu_model"],
    )
    pools = session.execute(
        select(CapacityPool).order_by(CapacityPool.cluster_id, CapacityPool.name)
    ).scalars()
    for pool in pools:
        labels = [pool.cluster_id, pool.name, pool.tier, pool.gpu_model]
        total_g.add_metric(labels, pool.nodes * pool.gpus_per_node)
        used_g.add_metric(labels, used.get((pool.cluster_id, pool.name), 0))
    yield from (total_g, used_g)

    phases = Counter(phase for (phase,) in session.execute(select(Rollout.phase)))
    g = _gauge("rollouts", "Rollouts by phase (finished ones included).", ["phase"])
    for phase in sorted(set(get_args(Phase)) | set(phases)):
        g.add_metric([phase], phases[phase])
    yield g
    yield from _shadow_metrics(session)
    yield from budget_metrics(session)
    yield from node_metrics(session)


def _shadow_metrics(session: Session) -> Iterator[Metric]:
    """The last shadow comparison of each deployment's latest rollout with a shadow phase."""
    agreement = _gauge(
        "shadow_agreement",
        "Share of greedy shadow copies whose output equals the original's (latest shadow phase).",
        ["deployment"],
    )
    compared = _gauge("shadow_compared_requests", "Shadow copies paired with their original.", ["deployment"])
    copies = _gauge("shadow_copies", "Shadow copies that finished in the phase's window.", ["deployment"])
    dropped = _gauge("shadow_dropped", "Copies the share asked for that never came.", ["deployment"])
    errors = _gauge("shadow_errors", "Errors on the compared requests, by side.", ["deployment", "side"])
    latency = _gauge(
        "shadow_latency_seconds", "p50/p90 TTFT and ITL of the compared requests, by side.",
        ["deployment", "measure", "quantile", "side"],
    )  # fmt: skip
    running = _gauge("shadow_running", "1 while the deployment's shadow phase runs.", ["deployment"])
    rows = session.execute(
        select(Deployment.name, Rollout.shadow_phase, Rollout.shadow_stats)
        .join(Deployment, Deployment.id == Rollout.deployment_id)
        .where(Rollout.shadow_share.is_not(None))
        .order_by(Rollout.id)
    ).all()
    latest = {name: (phase, stats or {}) for name, phase, stats in rows}  # the last one wins
    for name, (phase, stats) in sorted(latest.items()):
        running.add_metric([name], 1 if phase == "running" else 0)
        greedy = stats.get("greedy") or {}
        if greedy.get("agreement") is not None:
            agreement.add_metric([name], float(greedy["agreement"]))
        compared.add_metric([name], int(stats.get("compared") or 0))
        copies.add_metric([name], int(stats.get("copies") or 0))
        dropped.add_metric([name], int(stats.get("dropped") or 0))
        for side in ("original", "copy"):
            errors.add_metric([name, side], float((stats.get("errors") or {}).get(side) or 0))
            for measure in ("ttft", "itl"):
                for q in ("p50", "p90"):
                    value = (stats.get(f"{measure}_{q}_s") or {}).get(side)
                    if value is not None:
                        latency.add_metric([name, measure, q, side], float(value))
    yield from (agreement, compared, copies, dropped, errors, latency, running)


def _state_write_metrics(session: Session) -> Iterator[Metric]:
    """What each agent's last heartbeat said about its state files (a full disk)."""
    failing = _gauge(
        "cluster_state_writes_failing",
        "State files a cluster's agent cannot write now (keys, routes, desired state: a full disk).",
        ["cluster"],
    )
    failures = CounterMetricFamily(
        PREFIX + "cluster_state_write_failures",
        "Failed state-file writes each cluster's agent reported since it started.",
        labels=["cluster"],
    )
    for cluster_id, load in session.execute(select(Cluster.id, Cluster.load).order_by(Cluster.id)):
        load = load if isinstance(load, dict) else {}
        failing.add_metric([cluster_id], len(load.get("state_writes_failing") or {}))
        failures.add_metric([cluster_id], int(load.get("state_write_failures") or 0))
    yield from (failing, failures)


def _reconcile_metrics(stats: ReconcileStats) -> Iterator[Metric]:
    c = CounterMetricFamily(PREFIX + "reconcile_failures", "Reconcile passes that raised.")
    c.add_metric([], stats.failures)
    yield c
    h = HistogramMetricFamily(
        PREFIX + "reconcile_duration_seconds",
        "Successful reconcile passes: placement, writes (publishing excluded).",
    )
    h.add_metric([], stats.cumulative(), sum_value=stats.seconds_sum)
    yield h
    if stats.last_success_at is not None:
        yield GaugeMetricFamily(
            PREFIX + "last_reconcile_timestamp_seconds",
            "Unix time of the last successful reconcile pass.",
            value=stats.last_success_at,
        )


class ElectionCollector(Collector):
    """This instance's part in leader election (`app.state.elector`; None: it does not stand)."""

    def __init__(self, elector: Callable[[], object | None]) -> None:
        self.elector = elector

    def collect(self) -> Iterator[Metric]:
        elector = self.elector()
        is_leader = bool(elector is not None and elector.is_leader)
        record = getattr(elector, "last_record", None)
        yield GaugeMetricFamily(
            PREFIX + "is_leader",
            "1 while this instance leads (runs the control loops).",
            value=int(is_leader),
        )
        changes = CounterMetricFamily(PREFIX + "leader_changes", "Times this instance became the leader.")
        changes.add_metric([], getattr(elector, "leader_changes", 0))
        yield changes
        raises = CounterMetricFamily(
            PREFIX + "epoch_floor_raises",
            "Times this instance, leading, raised the lease's epoch above one seen on the wire "
            "(a bucket or an agent's fence): the database had lost its history.",
        )
        raises.add_metric([], getattr(elector, "floor_raises", 0))
        yield raises
        yield GaugeMetricFamily(
            PREFIX + "epoch",
            "The leader lease's epoch as this instance last read it (the fencing token).",
            value=record.epoch if record is not None else 0,
        )
        stats: ReconcileStats | None = getattr(elector, "renew_stats", None)
        if stats is not None:
            h = HistogramMetricFamily(
                PREFIX + "lease_renew_seconds", "Round trips of lease acquires and renews that succeeded."
            )
            h.add_metric([], stats.cumulative(), sum_value=stats.seconds_sum)
            yield h


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Sync on purpose: FastAPI runs it in a thread, so the database reads do not block."""
    registry = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        app_state = request.app.state
        registry = CollectorRegistry(auto_describe=False)
        registry.register(
            ControlPlaneCollector(
                lambda: app_state.ctx.sessions,
                lambda: getattr(getattr(app_state, "loops", None), "stats", None),
                lambda: getattr(getattr(app_state, "loops", None), "rejections", None),
                lambda: getattr(getattr(getattr(app_state, "loops", None), "autoscale", None), "last", None),
                lambda: getattr(
                    getattr(getattr(app_state, "loops", None), "autoscale", None), "errors", None
                ),
                lambda: getattr(getattr(app_state, "loops", None), "scheduled", None),
            )
        )
        registry.register(RefusalCollector(PREFIX))
        registry.register(ElectionCollector(lambda: getattr(app_state, "elector", None)))
        registry.register(
            CostCollector(lambda: app_state.ctx.sessions, app_state.ctx.settings.cost_metrics_interval_s)
        )
        app_state.metrics_registry = registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
