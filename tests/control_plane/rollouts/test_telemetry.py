"""The rollout telemetry's memory bound: only a deployment with an open rollout keeps an
hour of samples; every other deployment keeps a few minutes, so a fleet serving steadily
with no rollout holds a flat amount, however long it runs."""

from __future__ import annotations

from control_plane.rollouts.telemetry import UsageWindows
from fleet_base.protocol import UsageRecord


def record(deployment: str) -> UsageRecord:
    return UsageRecord(cluster="c1", key_id="k", deployment=deployment, version=1, status=200, ttft_s=0.1)


def feed(w: UsageWindows, deployments: list[str], start: float, seconds: int, per_s: int = 10) -> None:
    for t in range(seconds):
        for _ in range(per_s):
            for d in deployments:
                w.add(record(d), at=start + t)


def test_unwatched_deployments_hold_the_idle_retention_only() -> None:
    w = UsageWindows(retention_s=3600, idle_retention_s=300)
    feed(w, ["quiet", "busy"], start=0, seconds=1200)
    assert w.held() == 2 * 300 * 10 + 2 * 10  # both at the idle bound (the edge second counts)
    feed(w, ["quiet", "busy"], start=1200, seconds=1200)
    assert w.held() == 2 * 300 * 10 + 2 * 10  # flat: twenty more minutes add nothing


def test_a_watched_deployment_keeps_its_whole_window_and_drops_back_when_it_closes() -> None:
    w = UsageWindows(retention_s=3600, idle_retention_s=300)
    feed(w, ["web"], start=0, seconds=100)
    w.watch(frozenset({"web"}))  # a rollout opened at t=100: what came before is still there
    feed(w, ["web"], start=100, seconds=1100)
    assert w.stats("web", 1, since=50).requests == 1150 * 10
    w.watch(frozenset())  # the rollout ended
    feed(w, ["web"], start=1200, seconds=1)
    assert w.stats("web", 1, since=0).requests == 301 * 10


def test_the_count_bound_holds_for_a_watched_deployment() -> None:
    w = UsageWindows(retention_s=3600, max_per_deployment=500)
    w.watch(frozenset({"web"}))
    feed(w, ["web"], start=0, seconds=100)
    assert w.held() == 500
