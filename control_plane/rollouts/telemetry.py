"""Gateway telemetry as rollouts read it: finished requests per deployment and version,
kept in memory for a bounded time, summarised over a window.

Records are stamped with the control plane's clock when they arrive (gateway clocks may
drift), so a window is "what arrived since the step began". No I/O here: the rollout
loop feeds `add()` from its NATS subscription on `fleet.v1.usage.*`.

Only a deployment with an open rollout keeps the full retention: the others keep a few
minutes (enough for a rollout that starts now to find its first samples), so the memory
held is the traffic of open windows, not of the whole fleet for an hour.

A record is held once by its `record_id`: after a restart or a change of leader the
open windows are replayed from the stream while the live subscription already runs, and a
record may come both ways.

Shadow copies (`UsageRecord.shadow`) are kept apart: they never count as a version's
requests for the canary guards, only in `shadow()`, paired with their originals.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.rollouts.policy import VersionStats
from control_plane.rollouts.quantiles import percentile
from control_plane.rollouts.shadow import Comparison, Finished, compare
from fleet_base.protocol import UsageRecord


@dataclass(frozen=True)
class Sample:
    at: float
    version: int | None
    error: bool
    ttft_s: float | None
    record_id: str | None = None
    itl_s: float | None = None


@dataclass(frozen=True)
class Copy:
    at: float
    version: int | None
    copy: Finished


def p90(values: list[float]) -> float | None:
    """Nearest-rank 90th percentile."""
    return percentile(values, 0.9)


class UsageWindows:
    """Recent requests per deployment. A request's TTFT is the gateway's time to the
    first token for streams and its whole latency otherwise (a non-streamed answer's
    first byte is its last), so both versions are compared on the same measure."""

    def __init__(
        self,
        retention_s: float = 3600.0,
        max_per_deployment: int = 200_000,
        clock: Callable[[], float] = time.time,
        idle_retention_s: float = 300.0,
    ) -> None:
        self.retention_s = retention_s
        self.idle_retention_s = idle_retention_s
        self.watched: frozenset[str] = frozenset()  # deployments with an open rollout
        self.max_per_deployment = max_per_deployment
        self.clock = clock
        self._samples: dict[str, collections.deque[Sample]] = {}
        self._copies: dict[str, collections.deque[Copy]] = {}
        self._ids: dict[str, set[str]] = {}  # record ids held, per deployment
        self.received = 0
        self.duplicates = 0

    def add(self, record: UsageRecord, at: float | None = None) -> None:
        """One record, stamped now (or `at`: a record replayed from the stream)."""
        ttft = record.ttft_s if record.ttft_s is not None else (record.latency_s or None)
        if record.status == 499:  # the client left: says nothing about the version
            return
        now = self.clock() if at is None else at
        if record.record_id is not None:
            ids = self._ids.setdefault(record.deployment, set())
            if record.record_id in ids:
                self.duplicates += 1
                return
            ids.add(record.record_id)
        if record.shadow:
            self._add_copy(record, ttft, now)
            return
        sample = Sample(now, record.version, record.status >= 500, ttft, record.record_id, record.itl_s)
        queue = self._samples.setdefault(record.deployment, collections.deque(maxlen=self.max_per_deployment))
        self._make_room(record.deployment, queue)
        queue.append(sample)
        self.received += 1
        self._prune(record.deployment, queue, sample.at)

    def _add_copy(self, record: UsageRecord, ttft: float | None, now: float) -> None:
        finished = Finished(
            record_id=record.record_id,
            error=record.status >= 500 or record.attempt_failed,
            ttft_s=ttft,
            itl_s=record.itl_s,
            shadow_of=record.shadow_of,
            greedy_match=record.greedy_match,
            first_diff_token=record.first_diff_token,
        )
        queue = self._copies.setdefault(record.deployment, collections.deque(maxlen=self.max_per_deployment))
        self._make_room(record.deployment, queue)
        queue.append(Copy(now, record.version, finished))
        self.received += 1
        self._prune(record.deployment, queue, now)

    def watch(self, deployments: frozenset[str]) -> None:
        """The deployments whose rollouts are open (the rollout tick sets this, from its
        thread: one assignment). A deployment no longer watched drops to the idle retention
        on its next record; one that sees no more traffic holds what it had, never more."""
        self.watched = deployments

    def _prune(self, deployment: str, queue: collections.deque, now: float) -> None:
        keep = self.retention_s if deployment in self.watched else self.idle_retention_s
        while queue and queue[0].at < now - keep:
            self._forget(deployment, queue.popleft())

    def _make_room(self, deployment: str, queue: collections.deque) -> None:
        """A full queue drops its oldest item on append: its id goes with it."""
        if queue.maxlen is not None and len(queue) >= queue.maxlen:
            self._forget(deployment, queue.popleft())

    def _forget(self, deployment: str, item: Sample | Copy) -> None:
        record_id = item.copy.record_id if isinstance(item, Copy) else item.record_id
        if record_id is not None:
            self._ids.get(deployment, set()).discard(record_id)

    def held(self) -> int:
        """Samples and copies held, all deployments (what the memory bound is about)."""
        return sum(map(len, list(self._samples.values()))) + sum(map(len, list(self._copies.values())))

    def samples(self, deployment: str, since: float) -> list[Sample]:
        """The deployment's samples since `since`, oldest first (what `stats` summarises)."""
        copied = list(self._samples.get(deployment, ()))  # one C-level copy: safe from another thread
        return [s for s in copied if s.at >= since]

    def stats(self, deployment: str, version: int, since: float) -> VersionStats:
        samples = [s for s in self._samples.get(deployment, ()) if s.at >= since and s.version == version]
        ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
        return VersionStats(
            requests=len(samples),
            errors=sum(1 for s in samples if s.error),
            ttft_p90_s=p90(ttfts),
            ttft_samples_s=tuple(ttfts),
        )

    def shadow(self, deployment: str, version: int, since: float, share: float) -> Comparison:
        """Copies to `version` since `since` against the deployment's originals they name.
        An original may finish before or after its copy; both must be in the window."""
        originals = [
            Finished(s.record_id, s.error, s.ttft_s, s.itl_s)
            for s in list(self._samples.get(deployment, ()))
            if s.at >= since
        ]
        copies = [
            c.copy for c in list(self._copies.get(deployment, ())) if c.at >= since and c.version == version
        ]
        return compare(originals, copies, share)
