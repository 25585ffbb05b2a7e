"""Round-trip times between regions: measured where Skyplane measured them
(`../shared/data/skyplane_latency.csv`, April 2022, 69 AWS/GCP/Azure regions), else
estimated from great-circle distance between the regions' cities.

Region ids are `provider:region` (`gcp:us-central1`, `azure:eastus`, `aws:us-west-2`);
Skyplane's GCP ids carry a zone (`gcp:us-central1-a`) that is dropped. A bare region
name is looked up in every provider.
"""

from __future__ import annotations

import csv
import math
import re
from functools import lru_cache
from pathlib import Path

from control_plane.geo.regions import REGION_COORDS

EARTH_RADIUS_KM = 6371.0
# RTT ~= FIBER_MS_PER_KM * path + BASE_MS, with the path 1.5x the great circle
# (light in fibre covers ~200 km/ms one way; cables do not follow great circles).
FIBER_MS_PER_KM = 2 / 200.0
ROUTE_FACTOR = 1.8  # fitted: the median measured/estimated ratio over Skyplane pairs is ~1
BASE_MS = 2.0
SAME_REGION_MS = 1.0

DEFAULT_CSV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "skyplane_latency.csv"
_ZONE = re.compile(r"^(gcp:[a-z]+-[a-z]+\d+)-[a-z]$")


def canonical(region_id: str) -> str:
    region_id = region_id.strip().lower()
    m = _ZONE.match(region_id)
    return m.group(1) if m else region_id


def great_circle_km(a: tuple[float, float], b: tuple[float, float]) -> float:
    lat1, lon1, lat2, lon2 = map(math.radians, (a[0], a[1], b[0], b[1]))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def estimate_rtt_ms(km: float) -> float:
    """RTT estimate from distance (about 5-7 ms one way per time zone at mid latitudes)."""
    return BASE_MS + FIBER_MS_PER_KM * ROUTE_FACTOR * km if km > 0 else SAME_REGION_MS


class LatencyMatrix:
    """Measured RTTs (ms, mean of the two directions' averages) with a great-circle fallback."""

    def __init__(self, rtt: dict[tuple[str, str], float] | None = None) -> None:
        self._rtt = dict(rtt or {})
        self.regions = sorted({r for pair in self._rtt for r in pair})

    @classmethod
    def from_csv(cls, path: str | Path) -> LatencyMatrix:
        sums: dict[tuple[str, str], list[float]] = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    a, b = canonical(row["src_region"]), canonical(row["dst_region"])
                    value = float(row.get("avg_rtt") or row["min_rtt"])
                except (KeyError, TypeError, ValueError):
                    continue
                if a == b or not math.isfinite(value) or value <= 0:
                    continue
                sums.setdefault(tuple(sorted((a, b))), []).append(value)
        return cls({k: sum(v) / len(v) for k, v in sums.items()})

    def resolve(self, region: str, provider: str = "") -> str:
        """The `provider:region` id of a region name (unknown names come back as given)."""
        region = canonical(region)
        if ":" in region:
            return region
        if provider:
            return f"{provider.lower()}:{region}"
        for prefix in ("gcp", "aws", "azure"):
            if f"{prefix}:{region}" in REGION_COORDS:
                return f"{prefix}:{region}"
        return region

    def coordinates(self, region: str, provider: str = "") -> tuple[float, float] | None:
        return REGION_COORDS.get(self.resolve(region, provider))

    def measured(self, a: str, b: str) -> float | None:
        return self._rtt.get(tuple(sorted((a, b))))

    def rtt_ms(self, a: str, b: str, provider: str = "", provider_b: str = "") -> float | None:
        """RTT between two regions (`provider` qualifies `a`, `provider_b` qualifies `b`);
        None when neither a measurement nor both regions' coordinates are known."""
        ra, rb = self.resolve(a, provider), self.resolve(b, provider_b)
        if ra == rb:
            return SAME_REGION_MS
        got = self.measured(ra, rb)
        if got is not None:
            return got
        ca, cb = REGION_COORDS.get(ra), REGION_COORDS.get(rb)
        if ca is None or cb is None:
            return None
        return estimate_rtt_ms(great_circle_km(ca, cb))


@lru_cache(maxsize=1)
def default_latency() -> LatencyMatrix:
    """Skyplane's measurements when the shared data is present, else estimates only."""
    return LatencyMatrix.from_csv(DEFAULT_CSV) if DEFAULT_CSV.exists() else LatencyMatrix()
