"""Geography of the fleet: region coordinates, inter-region RTTs (measured, else
great-circle estimates) and the geo-aware routing table each deployment publishes. Pure."""

from control_plane.geo.latency import LatencyMatrix, default_latency, estimate_rtt_ms, great_circle_km
from control_plane.geo.regions import REGION_COORDS

__all__ = ["REGION_COORDS", "LatencyMatrix", "default_latency", "estimate_rtt_ms", "great_circle_km"]
