"""The cost gauges on the control plane's /metrics: what each deployment's running replicas
cost per hour now (their open replica intervals, at the price each was started at), and its
dollars per million tokens over the last hour by phase (the cost report's rule).

The report reads an hour of usage records, so the values are recomputed at most once per
`interval_s` (FLEET_COST_METRICS_INTERVAL_S) and served from memory in between; a scrape
never waits on more than one report per interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.cost.report import cost_report
from control_plane.db.models import ReplicaInterval

log = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "total")
WINDOW_S = 3600.0

Values = tuple[dict[str, float], dict[tuple[str, str], float]]


def held_hourly_dollars(session: Session) -> dict[str, float]:
    """deployment -> dollars per hour of the GPUs its running replicas hold."""
    rows = session.execute(
        select(ReplicaInterval.deployment, func.sum(ReplicaInterval.gpus * ReplicaInterval.hourly_price))
        .where(ReplicaInterval.ended_at.is_(None))
        .group_by(ReplicaInterval.deployment)
    ).all()
    return {name: float(dollars or 0.0) for name, dollars in rows}


def per_million_tokens(session: Session, now: float) -> dict[tuple[str, str], float]:
    """(deployment, phase) -> dollars per million tokens over the last hour (phases with
    no tokens are left out)."""
    report = cost_report(session, now - WINDOW_S, now, "deployment")
    out: dict[tuple[str, str], float] = {}
    for row in report.rows:
        for phase in PHASES:
            value = row.dollars_per_mtok.get(phase)
            if value is not None:
                out[(row.group, phase)] = float(value)
    return out


class CostCollector(Collector):
    def __init__(
        self,
        sessions: Callable[[], sessionmaker[Session]],
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sessions = sessions
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._values: Values = ({}, {})

    def values(self) -> Values:
        """The cached values, recomputed when older than `interval_s`; on a failure the
        last values stay (logged), so a scrape still answers."""
        with self._lock:
            now = self.clock()
            if self._at is None or now - self._at >= self.interval_s:
                self._at = now
                try:
                    with self.sessions()() as session:
                        self._values = (held_hourly_dollars(session), per_million_tokens(session, now))
                except Exception:
                    log.exception("computing the cost gauges failed; serving the last values")
            return self._values

    def collect(self) -> Iterator[Metric]:
        hourly, per_mtok = self.values()
        g = GaugeMetricFamily(
            "fleet_cost_hourly_dollars",
            "Dollars per hour of the GPUs each deployment's running replicas hold now.",
            labels=["deployment"],
        )
        for name, dollars in sorted(hourly.items()):
            g.add_metric([name], dollars)
        yield g
        g = GaugeMetricFamily(
            "fleet_cost_per_million_tokens",
            "Dollars per million tokens over the last hour, by phase (prefill, decode, total).",
            labels=["deployment", "phase"],
        )
        for (name, phase), dollars in sorted(per_mtok.items()):
            g.add_metric([name, phase], dollars)
        yield g
