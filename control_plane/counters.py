"""Counters the control plane keeps about itself, read by `GET /metrics` at scrape time:
plain numbers, so the loops and the inbox stay free of any metrics library.

`ReconcileStats` times the reconcile passes. `Rejections` counts the messages the control
plane refused, per (subject pattern, reason), for `fleet_control_plane_rejected_messages_total`,
each logged with its reason and skipped. The label is the subject *pattern*
(`fleet.v1.heartbeat.*`), not the subject: a sender must not be able to mint label values.
Logging is at warning for the first of each (pattern, reason) per minute and at debug after,
so a flood of one bad message cannot flood the log. The same object counts reports that
decode but speak beyond their sender (`refuse`, `fleet_control_plane_reports_refused_total`,
by kind and reason, `control_plane.report_scope`) and the per-deployment failures a loop
caught and went on from (`fail`, `fleet_control_plane_loop_failures_total`)."""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from fleet_base.wire import REASONS

log = logging.getLogger(__name__)

# Seconds; a reconcile is a few queries plus placement: milliseconds on a small fleet,
# seconds on a large one with the MIP placer.
RECONCILE_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ReconcileStats:
    """Reconcile passes: how many, how many failed, and how long the successful ones took."""

    buckets: tuple[float, ...] = RECONCILE_BUCKETS
    passes: int = 0
    failures: int = 0
    seconds_sum: float = 0.0
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: +Inf
    last_success_at: float | None = None  # Unix seconds

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.passes += 1
        self.seconds_sum += seconds
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.last_success_at = time.time()

    def fail(self) -> None:
        self.failures += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus bucket pairs (`le`, cumulative count), ending with +Inf."""
        out, total = [], 0
        for bound, count in zip([*map(repr, self.buckets), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


LOG_EVERY_S = 60.0
# Every (pattern, reason) is exported, 0 until it happens, so dashboards always have series.
PATTERNS = ("fleet.v1.heartbeat.*", "fleet.v1.events.*", "fleet.v1.usage.*")
# Report kind -> the reasons it can be refused for (all exported, 0 until they happen).
REFUSALS: dict[str, tuple[str, ...]] = {
    "usage": ("future", "expired", "unknown_key", "not_served"),
    "heartbeat": ("not_placed",),
    "demand": ("budget", "unknown_deployment"),
    "rollout_sample": ("not_hosted",),
}
LOOPS = ("autoscale",)


class Rejections:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.failures: Counter[str] = Counter()
        self._logged: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()  # stores run in threads

    def reject(self, pattern: str, reason: str, subject: str, detail: object) -> None:
        with self._lock:
            self.counts[(pattern, reason)] += 1
        self._log((pattern, reason), "rejected a message on %s (%s): %s", subject[:120], reason, detail)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return {**{(p, r): 0 for p in PATTERNS for r in REASONS}, **self.counts}

    def refuse(self, kind: str, reason: str, detail: object, n: int = 1) -> None:
        """`n` reports of `kind` that speak beyond their sender (a key, deployment, replica
        or time it has no say in): counted and logged like a rejected message."""
        with self._lock:
            self.refusals[(kind, reason)] += n
        self._log((f"report:{kind}", reason), "refused %d %s report(s) (%s): %s", n, kind, reason, detail)

    def fail(self, loop: str, detail: object) -> None:
        """One unit of a loop's work (one deployment's decision) failed and was skipped."""
        with self._lock:
            self.failures[loop] += 1
        self._log((f"loop:{loop}", "failed"), "%s: skipped after a failure: %s", loop, detail)

    def _log(self, key: tuple[str, str], fmt: str, *args: object) -> None:
        """Warning for the first of `key` per minute, debug after; the last arg (the detail)
        is cut to 300 characters."""
        now = time.monotonic()
        with self._lock:
            loud = now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S
            if loud:
                self._logged[key] = now
        text = str(args[-1])
        text = text if len(text) <= 300 else text[:297] + "..."
        log.log(logging.WARNING if loud else logging.DEBUG, fmt, *args[:-1], text)

    def refusal_snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            zeros = {(k, r): 0 for k, reasons in REFUSALS.items() for r in reasons}
            return {**zeros, **self.refusals}

    def failure_snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**dict.fromkeys(LOOPS, 0), **self.failures}
