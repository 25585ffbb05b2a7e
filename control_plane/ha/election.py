"""Who leads, decided the Kubernetes client-go way: from what this process observed and
its own monotonic clock, never by comparing wall clocks across hosts.

A candidate remembers the local time at which it last saw the lease record change (its
`version` moves on every acquire and renew); it takes the lease over only after the holder's
`lease_s` has passed on its own clock with no change. A leader believes it leads only until
`renew_deadline_s` after the START of its last good renew, since the write may have landed
at any point after that start.

Safety under clock rate drift: with every clock's rate within [1 - rho, 1 + rho] of real time,
a leader's belief ends at most `renew_deadline_s / (1 - rho)` after its renew landed, and a
follower takes over at least `lease_s / (1 + rho)` after it; so two leaders never believe at
once while `max_rate_drift(lease_s, renew_deadline_s)` > rho (1/5 with 15 s and 10 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class LeaseRecord:
    """The lease as stored: `holder` None when free or released; `epoch` moves on every
    acquire (the fencing token); `version` on every acquire and renew (the change a follower
    watches)."""

    holder: str | None
    epoch: int
    version: int
    lease_s: float


class Action(StrEnum):
    acquire = "acquire"  # compare-and-set on the version seen; a new epoch
    renew = "renew"  # we hold it: bump the version under our epoch
    follow = "follow"  # someone else holds a live lease


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def max_rate_drift(lease_s: float, renew_deadline_s: float) -> float:
    """The largest clock rate error (a fraction of real time) under which a leader's belief
    always ends before any follower takes over: rd / (1 - rho) < lease / (1 + rho)."""
    return (lease_s - renew_deadline_s) / (lease_s + renew_deadline_s)


class Candidate:
    """One process's view of the election. `observe` says what to do with a record read at
    local time `now`; the caller reports the outcome of its write with `acquired`, `renewed`
    or `lost`, passing the local time at which that write call STARTED."""

    def __init__(self, me: str, lease_s: float, renew_deadline_s: float) -> None:
        if not 0 < renew_deadline_s < lease_s:
            raise ValueError(f"renew deadline {renew_deadline_s} must be in (0, lease {lease_s})")
        self.me = me
        self.lease_s = lease_s
        self.renew_deadline_s = renew_deadline_s
        self.epoch = 0  # ours while leading
        self._seen: tuple[str | None, int, int] | None = None  # (holder, epoch, version)
        self._seen_at = 0.0
        self._renewed_at: float | None = None  # start of the last good acquire/renew; None: not leading

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None

    def observe(self, record: LeaseRecord | None, now: float) -> Decision:
        if record is None:
            return Decision(Action.acquire, "no lease yet")
        key = (record.holder, record.epoch, record.version)
        if key != self._seen:
            self._seen, self._seen_at = key, now
        if record.holder is None:
            return Decision(Action.acquire, "lease released")
        if record.holder == self.me:
            if self.leading and record.epoch == self.epoch:
                return Decision(Action.renew, "we hold it")
            # ours from an earlier term we already gave up: take a new epoch, never revive the old one
            return Decision(Action.acquire, "stale lease of ours")
        if now - self._seen_at >= record.lease_s:
            return Decision(Action.acquire, f"unchanged for {now - self._seen_at:.1f}s")
        return Decision(Action.follow, f"held by {record.holder}")

    def acquired(self, record: LeaseRecord, started: float, now: float | None = None) -> bool:
        """Whether we lead by this acquire: not when its answer came (`now`, default at once)
        after the renew deadline of its own start, since a successor may already hold a
        newer epoch; the stale lease of ours is taken anew on the next observation."""
        self._seen, self._seen_at = (record.holder, record.epoch, record.version), started
        if now is not None and now >= started + self.renew_deadline_s:
            self.lost()
            return False
        self.epoch = record.epoch
        self._renewed_at = started
        return True

    def renewed(self, record: LeaseRecord, started: float) -> None:
        if not self.leading or record.epoch != self.epoch:
            return  # a renew that answered after we gave up: we do not lead again by it
        self._renewed_at = started
        self._seen = (record.holder, record.epoch, record.version)

    def lost(self) -> None:
        """Our write was refused (someone else moved the lease on), or we stepped down."""
        self._renewed_at = None
        self.epoch = 0

    def deadline(self) -> float | None:
        """Local time at which a leader must have stopped: None when not leading."""
        return None if self._renewed_at is None else self._renewed_at + self.renew_deadline_s

    def must_stop(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def believes_leading(self, now: float) -> bool:
        return self.leading and not self.must_stop(now)
