"""Pipeline requests at the gateway: the facts of a hop gathered now (the pipeline from the
routing tables, which steps are healthy here, the peers where every step is ready), the
decision (`agent.gateway.pipeline_route.decide`) and what it is measured by: hops by
outcome (`fleet_pipeline_requests_total`) and each hop's time at this gateway
(`fleet_pipeline_step_seconds`). The routing plan then keeps a local hop here or sends a
forwarded one to its peer (`agent.gateway.router`)."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from agent.gateway.errors import GatewayError
from agent.gateway.metrics import LATENCY_BUCKETS
from agent.gateway.pipeline_route import (
    PipelineFacts,
    PipelineHop,
    decide,
    owner_of,
    ready_peers,
    request_id_for,
)
from agent.gateway.router import Router
from fleet_base.pipelines import PIPELINE_HEADER, PIPELINE_REQUEST_HEADER, PIPELINE_STEP_HEADER, PipelineSpec
from fleet_base.residency import permits

REFUSAL_CODES = {
    "not-ready-anywhere": "pipeline_unavailable",
    "step-down": "pipeline_step_unavailable",
    "owner-unreachable": "pipeline_owner_unavailable",
}


MINTED_TTL_S = 600.0
MINTED_MAX = 100_000


class MintedIds:
    """The pipeline request ids this gateway minted, each with the API key it was minted for.
    An id is only a cluster name and random hex, which a client could invent to pick the
    cluster of its first hop; the owner honours an id only for the key it gave it to, for
    `ttl_s` after its last use (bounded: the least recently used go first)."""

    def __init__(
        self,
        ttl_s: float = MINTED_TTL_S,
        max_ids: int = MINTED_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self.clock = clock
        self._ids: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def mint(self, request_id: str, key_id: str) -> None:
        self._ids[request_id] = (key_id, self.clock() + self.ttl_s)
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def holds(self, request_id: str, key_id: str) -> bool:
        """`request_id` was minted here for `key_id` and is still remembered (refreshed)."""
        entry = self._ids.get(request_id)
        if entry is None:
            return False
        if entry[1] <= self.clock():
            del self._ids[request_id]
            return False
        if entry[0] != key_id:
            return False
        self._ids[request_id] = (key_id, self.clock() + self.ttl_s)
        self._ids.move_to_end(request_id)
        return True

    def __len__(self) -> int:
        return len(self._ids)


class PipelineRouting:
    def __init__(
        self, cluster: str, router: Router, registry: CollectorRegistry, retry_after_s: int = 1
    ) -> None:
        self.cluster = cluster
        self.router = router
        self.retry_after_s = retry_after_s
        self.minted = MintedIds()
        self.requests = Counter(
            "fleet_pipeline_requests",
            "Pipeline hops by the gateway's decision: local (served here), forwarded (sent whole "
            "to the cluster that runs or will run the pipeline request), refused (503).",
            ["pipeline", "cluster", "outcome"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "fleet_pipeline_step_seconds",
            "A pipeline hop's time at this gateway, arrival to the last byte (answered 2xx), by step.",
            ["pipeline", "step", "cluster"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def find(self, name: str) -> PipelineSpec | None:
        """The pipeline a routing table here names (each step's table carries it)."""
        view = self.router.view
        for deployment in sorted(view.routes):
            for spec in view.routes[deployment].pipelines:
                if spec.name == name:
                    return spec
        return None

    def admit(
        self,
        headers: Mapping[str, str],
        deployment: str,
        *,
        forwarded: bool,
        allowed: frozenset[str] | None,
        key_id: str = "",
    ) -> PipelineHop | None:
        """The hop a request with `X-Fleet-Pipeline` is, routed; None without the header.
        400 for a pipeline unknown here or a model that is none of its steps, 503 with the
        reason when the hop may not be served (nothing was sent anywhere). An id naming this
        cluster that it did not mint for `key_id` is no id: the hop is a new request."""
        name = headers.get(PIPELINE_HEADER)
        if not name:
            return None
        spec = self.find(name)
        if spec is None:
            raise GatewayError(
                400,
                f"Unknown pipeline '{name[:63]}' ({PIPELINE_HEADER}); see `fleetctl pipeline ls`",
                code="pipeline_not_found",
            )
        step = next((s for s in spec.steps if s.deployment == deployment), None)
        if step is None:
            steps = ", ".join(s.name for s in spec.steps)  # not their deployments: the key may not see them
            raise GatewayError(
                400,
                f"The model '{deployment}' is not a step of pipeline '{spec.name}' (steps: {steps})",
                param="model",
                code="pipeline_step_mismatch",
            )
        asked = headers.get(PIPELINE_STEP_HEADER)
        if asked and asked != step.name:
            raise GatewayError(
                400,
                f"{PIPELINE_STEP_HEADER} '{asked[:63]}' does not match the model '{deployment}': "
                f"it is step '{step.name}' of pipeline '{spec.name}'",
                code="pipeline_step_mismatch",
            )
        request_id = headers.get(PIPELINE_REQUEST_HEADER)
        if owner_of(request_id) == self.cluster and not self.minted.holds(request_id or "", key_id):
            request_id = None
        decision = decide(self.facts(spec, step.name, request_id, forwarded, allowed))
        self.requests.labels(spec.name, self.cluster, decision.outcome).inc()
        if decision.action == "refuse":
            raise GatewayError(
                503,
                decision.message,
                code=REFUSAL_CODES[decision.reason],
                headers={"Retry-After": str(self.retry_after_s)},
            )
        carried = decision.request_id
        if decision.mint:
            carried = request_id_for(self.cluster, secrets.token_hex(12))
            self.minted.mint(carried, key_id)
        return PipelineHop(spec.name, step.name, decision, carried)

    def facts(
        self,
        spec: PipelineSpec,
        step: str,
        request_id: str | None,
        forwarded: bool,
        allowed: frozenset[str] | None,
    ) -> PipelineFacts:
        router = self.router
        here = {d: router.cluster_facts(d) for d in spec.deployments}
        ready_here = frozenset(d for d, c in here.items() if c.usable)
        deployment = next(s.deployment for s in spec.steps if s.name == step)
        order = [p.cluster for p in router.live_peers(deployment) if permits(allowed, p.jurisdiction)]
        ready_in: dict[str, frozenset[str]] = {}
        standby: set[str] = set()
        for d in spec.deployments:
            route = router.view.route(d)
            clusters = route.clusters if route is not None else []
            ready_in[d] = frozenset(
                c.cluster for c in clusters if c.healthy and c.replicas > 0 and c.gateway_url
            )
            standby.update(c.cluster for c in clusters if c.standby)
        return PipelineFacts(
            spec,
            step,
            self.cluster,
            ready_here,
            ready_peers=ready_peers(spec, order, ready_in),
            live_peers=frozenset(order),
            request_id=request_id,
            forwarded=forwarded,
            placed_here=all(c.usable or (c.coming and self.placed(d)) for d, c in here.items()),
            permitted_here=permits(allowed, router.jurisdiction()),
            standby_here=any(c.standby_here for c in here.values()),
            standby_peers=frozenset(standby - {self.cluster}),
        )

    def placed(self, deployment: str) -> bool:
        """The deployment's routing table lists this cluster (its replicas may be at zero)."""
        route = self.router.view.route(deployment)
        return route is not None and any(c.cluster == self.cluster for c in route.clusters)

    def finished(self, hop: PipelineHop, status: int, seconds: float) -> None:
        if 200 <= status < 300:
            self.step_seconds.labels(hop.pipeline, hop.step, self.cluster).observe(seconds)
