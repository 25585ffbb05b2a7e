"""Residency at the gateway: who may be served here at all, and the refusals.

The rule is `fleet_base.residency`'s: a request's allowed set is the intersection of its
deployment's policy (`RoutingTable.residency`) and its key's (`ApiKeyRecord.residency`).
This gateway's own jurisdiction comes from the desired state its agent writes
(`DesiredState.jurisdiction`); until it knows one, it is outside every policy.

- A key whose policy excludes this gateway is refused (403 `residency_violation`) before
  any work: its client must use an endpoint inside its jurisdictions. A peer's forward is
  held to the same rule with the key it vouches for, and to the deployment's policy too,
  since a forward is processed where it lands.
- Where requests go is the routing plan's (`agent.gateway.plan`), which drops every
  candidate outside the allowed set; when nothing permitted is left the client gets 503
  `residency_unavailable`, never a move elsewhere.
- `guard` is the last check at the one upstream opener: a target outside the set is never
  sent to, whatever chose it (counted, so a bug shows up on /metrics).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from agent.gateway.errors import GatewayError
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.protocol import RoutingTable
from fleet_base.residency import allowed, describe, permits

# key_outside: a key bound elsewhere; forward_outside: a peer's forward whose allowed set
# excludes this cluster; unavailable: nothing permitted could serve it (503); guard: the
# opener refused a target outside the set (a routing bug, never sent).
REASONS = ("key_outside", "forward_outside", "unavailable", "guard")


class ResidencyGate:
    def __init__(
        self, jurisdiction: Callable[[], str], registry: CollectorRegistry | None, retry_after_s: int = 1
    ) -> None:
        self._jurisdiction = jurisdiction
        self.retry_after_s = retry_after_s
        self.refused = Counter(
            "fleet_gateway_residency_refused_total",
            "Requests refused by residency, by reason (key_outside, forward_outside, unavailable, guard)",
            ["reason"],
            registry=registry,
        )
        for reason in REASONS:
            self.refused.labels(reason)

    @property
    def here(self) -> str:
        """This cluster's jurisdiction ("" while unknown: outside every policy)."""
        return self._jurisdiction()

    @staticmethod
    def allowed_for(record: ApiKeyRecord, route: RoutingTable | None) -> frozenset[str] | None:
        """The request's allowed set: the deployment's policy and the key's, intersected."""
        return allowed(route.residency if route is not None else None, record.residency)

    def admit_key(self, record: ApiKeyRecord) -> None:
        """403 unless the key's policy permits this gateway's jurisdiction."""
        policy = allowed(record.residency)
        if permits(policy, self.here):
            return
        self.refused.labels("key_outside").inc()
        raise GatewayError(
            403,
            f"API key '{record.key_id}' is bound by residency to {describe(policy)}; this gateway is "
            f"in {self._where()}. Send its requests to an endpoint inside its jurisdiction",
            code="residency_violation",
        )

    def admit_forward(self, deployment: str, policy: frozenset[str] | None, peer: str) -> None:
        """403 unless a peer's forward may be processed here (it is never sent on)."""
        if permits(policy, self.here):
            return
        self.refused.labels("forward_outside").inc()
        raise GatewayError(
            403,
            f"Cluster '{peer}' forwarded a request for '{deployment}' whose residency allows "
            f"{describe(policy)}; this cluster is in {self._where()} and does not process it",
            code="residency_violation",
        )

    def unavailable(self, deployment: str, policy: frozenset[str] | None) -> GatewayError:
        """503: no replica is available in a jurisdiction the request may be processed in."""
        self.refused.labels("unavailable").inc()
        return self.unavailable_error(deployment, policy)

    def unavailable_error(self, deployment: str, policy: frozenset[str] | None) -> GatewayError:
        return GatewayError(
            503,
            f"No replica of '{deployment}' is available in a jurisdiction its residency allows "
            f"({describe(policy)}); the request is not sent anywhere else. Retry shortly",
            code="residency_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def guard(self, policy: frozenset[str] | None, jurisdiction: str) -> bool:
        """Whether a chosen target may be sent the request; counts a refusal."""
        if permits(policy, jurisdiction):
            return True
        self.refused.labels("guard").inc()
        return False

    def _where(self) -> str:
        return f"jurisdiction '{self.here}'" if self.here else "no known jurisdiction"
