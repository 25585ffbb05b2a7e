"""Where a request goes: replica choice, canary version split, and peer order by distance.

Plain synchronous functions without I/O: they take a snapshot and return a decision, so
the same code runs in the live gateway and in `fleetctl simulate`. Which replica a request
goes to is the routing plan's (`agent.gateway.plan`); the routings it knows are listed
once, in `fleet_base.cluster_config.ROUTINGS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fleet_base.domain import Coordinates
from fleet_base.protocol import ClusterRoute, RoutingTable, VersionWeight


def pick_version(ready: set[int], weights: Sequence[VersionWeight], draw: float) -> int | None:
    """The version a request goes to, by the route's weights among versions ready here.

    `draw` is uniform in [0, 1) (the caller's random source, so this stays deterministic).
    None means "any ready replica": no weights, or no weighted version is ready here (a
    route that lags behind the replicas must not turn a servable request away).
    """
    weighted = [(w.version, w.weight) for w in weights if w.version in ready and w.weight > 0]
    total = sum(weight for _, weight in weighted)
    if not weighted or total <= 0:
        return None
    point = draw * total
    for version, weight in weighted:
        point -= weight
        if point < 0:
            return version
    return weighted[-1][0]


EARTH_RADIUS_KM = 6371.0


def great_circle_km(a: Coordinates, b: Coordinates) -> float:
    """Haversine distance."""
    lat1, lon1, lat2, lon2 = map(math.radians, (a.lat, a.lon, b.lat, b.lon))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def peer_order(
    route: RoutingTable | None, here: str, coordinates: Coordinates, region: str = ""
) -> list[ClusterRoute]:
    """Healthy peer clusters with a gateway for this deployment, nearest first; peers the
    route says run replicas come before those that run none. When the control plane
    ranked clusters for this gateway's region (`route.by_region`, by measured
    inter-region latency), that order is used; else great-circle distance."""
    if route is None:
        return []
    ranked = route.by_region.get(region) if region else None
    if ranked:
        return [c for c in ranked if c.cluster != here and c.healthy and c.gateway_url]
    peers = [c for c in route.clusters if c.cluster != here and c.healthy and c.gateway_url]
    return sorted(
        peers, key=lambda c: (c.replicas <= 0, great_circle_km(coordinates, c.coordinates), c.cluster)
    )


# Hops a request has made between gateways. A forwarded request (X-Fleet-Forwarded or a
# hop count >= MAX_HOPS) is served where it lands, never bounced back or on; with the
# cluster's credentials only the signed peer token says either (`agent.gateway.peers`).
FORWARDED_HEADER = "X-Fleet-Forwarded"
HOPS_HEADER = "X-Fleet-Hops"
MAX_HOPS = 1


def hops_of(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return MAX_HOPS  # garbled: treat as forwarded already


def should_spill(waiting: int, ready: int, per_replica: float | None) -> bool:
    """Forward to the nearest peer with room instead of queueing here: when more than
    `per_replica` requests per ready replica already wait (None: never on load alone)."""
    if per_replica is None or ready <= 0:
        return False
    return waiting >= per_replica * ready


def forwarded_from(headers, forwarded_header: str) -> str | None:
    """The gateway a request came from, or None when a client sent it. A request that
    made MAX_HOPS hops counts as forwarded even without the older header."""
    sender = headers.get(forwarded_header)
    if sender:
        return sender
    return "unknown-peer" if hops_of(headers.get(HOPS_HEADER)) >= MAX_HOPS else None
