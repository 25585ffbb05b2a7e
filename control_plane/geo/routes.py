"""Geo-aware routing: for each client region, the clusters serving a deployment in
order of expected latency, each with a weight from its capacity. Gateways read the
list for their own region to pick where a request they cannot serve goes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from control_plane.geo.latency import LatencyMatrix, estimate_rtt_ms, great_circle_km
from fleet_base.domain import Coordinates
from fleet_base.protocol import ClusterRoute


class ClientRegion(BaseModel):
    """Where requests come from: a region (of a cluster's gateway, or of known demand)."""

    model_config = ConfigDict(frozen=True)

    region: str
    provider: str = ""
    coordinates: Coordinates = Field(default_factory=Coordinates)


def expected_rtt_ms(client: ClientRegion, route: ClusterRoute, latency: LatencyMatrix) -> float:
    """Measured RTT, else great-circle estimate from region names, else from the
    coordinates both sides report (local fleets with made-up region names)."""
    rtt = latency.rtt_ms(client.region, route.region, provider=client.provider, provider_b=route.provider)
    if rtt is not None:
        return rtt
    if client.region == route.region:
        return 1.0
    a, b = client.coordinates, route.coordinates
    return estimate_rtt_ms(great_circle_km((a.lat, a.lon), (b.lat, b.lon)))


def rank_clusters(
    client: ClientRegion, routes: Sequence[ClusterRoute], latency: LatencyMatrix
) -> list[ClusterRoute]:
    """Healthy clusters nearest first; those with ready replicas before those without;
    `weight` is a cluster's share of the ready replicas (its capacity for spillover)."""
    healthy = [r for r in routes if r.healthy]
    total = sum(max(0, r.replicas) for r in healthy)
    ranked = [
        r.model_copy(
            update={
                "rtt_ms": round(expected_rtt_ms(client, r, latency), 3),
                "weight": round(max(0, r.replicas) / total, 6) if total else 0.0,
            }
        )
        for r in healthy
    ]
    return sorted(ranked, key=lambda r: (r.replicas <= 0, r.rtt_ms, -r.weight, r.cluster))


def routes_by_region(
    routes: Sequence[ClusterRoute], clients: Iterable[ClientRegion], latency: LatencyMatrix
) -> dict[str, list[ClusterRoute]]:
    """`RoutingTable.by_region`: client region -> ranked clusters."""
    out: dict[str, list[ClusterRoute]] = {}
    for client in clients:
        if client.region and client.region not in out:
            out[client.region] = rank_clusters(client, routes, latency)
    return out


MAX_PER_REGION = 16  # keeps a routing table small on NATS KV however many clusters there are


def by_region_for(
    routes: Sequence[ClusterRoute], clusters: Iterable, latency: LatencyMatrix | None = None
) -> dict[str, list[ClusterRoute]]:
    """`RoutingTable.by_region` for the reconcile loop: every cluster with a gateway is a
    client region (requests arrive there); `clusters` are snapshot rows (region,
    provider, coordinates, gateway_url)."""
    from control_plane.geo.latency import default_latency

    latency = latency or default_latency()
    clients = [
        ClientRegion(
            region=c.region, provider=c.provider if c.provider != "local" else "", coordinates=c.coordinates
        )
        for c in sorted(clusters, key=lambda c: c.id)
        if c.gateway_url and c.region
    ]
    return {
        region: ranked[:MAX_PER_REGION]
        for region, ranked in routes_by_region(routes, clients, latency).items()
    }
