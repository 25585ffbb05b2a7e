"""From what agents and gateways report to one `Observation` per deployment (pure).

- replicas: the latest heartbeat of each cluster (stale ones, older than `stale_s`, are
  left out): ready replicas' running and waiting sequences, ready and starting counts;
- gateway queues: the latest `Demand` per (cluster, deployment) younger than `demand_ttl_s`;
- settings: a deployment version's scaling columns as `AutoscaleSettings`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.protocol import Demand, Heartbeat, ReplicaState
from control_plane.autoscale.policy import AutoscaleSettings, Observation

STARTING = (ReplicaState.pending, ReplicaState.starting)


def observe(
    deployment: str,
    heartbeats: Iterable[Heartbeat],
    demands: Mapping[tuple[str, str], Demand],
    *,
    now: float,
    current: int,
    stale_s: float = 10.0,
    demand_ttl_s: float = 3.0,
) -> Observation:
    running = waiting = 0.0
    ready = starting = 0
    for hb in heartbeats:
        if now - hb.sent_at > stale_s:
            continue
        for r in hb.replicas:
            if r.deployment != deployment:
                continue
            if r.state == ReplicaState.ready:
                ready += 1
                running += r.load.running
                waiting += r.load.waiting
            elif r.state in STARTING:
                starting += 1
    queued = sum(
        d.queued for (_, dep), d in demands.items() if dep == deployment and now - d.at <= demand_ttl_s
    )
    return Observation(
        at=now, in_flight=running, queued=waiting + queued, ready=ready, starting=starting, current=current
    )


def settings_of(version: object, policy: str = "ours") -> AutoscaleSettings:
    """A `DeploymentVersion` row's scaling columns (window, delay, target, bounds)."""
    window = float(getattr(version, "autoscale_window_s", 60.0))
    return AutoscaleSettings(
        policy=policy,
        min_replicas=int(getattr(version, "min_replicas", 1)),
        max_replicas=int(getattr(version, "max_replicas", 1)),
        target_concurrency=float(getattr(version, "target_concurrency", 8.0)),
        stable_window_s=window,
        panic_window_s=max(min(window, 1.0), window / 10),
        scale_down_delay_s=float(getattr(version, "scale_down_delay_s", 0.0)),
        scale_to_zero=bool(getattr(version, "scale_to_zero", False))
        or int(getattr(version, "min_replicas", 1)) == 0,
        scale_to_zero_grace_s=min(window, 60.0),
    )
