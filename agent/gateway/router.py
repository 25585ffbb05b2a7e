"""The facts a routing plan is made of, gathered now: this cluster's ready replicas and
their load, live peers, the prefix index; and the plan made of them (`agent.gateway.plan`).
Also whether a target can take the request's LoRA adapter (loaded first if it must be)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agent.gateway.adapters import AdapterRouting
from agent.gateway.exchange import Call
from agent.gateway.liveness import PeerLiveness
from agent.gateway.load import LoadTracker
from agent.gateway.peers import PeerAuth
from agent.gateway.plan import (
    Attempt,
    ClusterFacts,
    PeerFacts,
    Plan,
    ReplicaFacts,
    RequestFacts,
    plan_route,
    plan_to_peer,
)
from agent.gateway.prefix import PrefixRouting
from agent.gateway.queue import ReplicaQueue
from agent.gateway.routing import peer_order
from agent.gateway.shadow_policy import serves_users
from agent.gateway.state import ClusterView
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES
from fleet_base.kv_tier_cost import PrefillTiming
from fleet_base.protocol import ReplicaStatus


def replica_facts(
    r: ReplicaStatus, tracker: LoadTracker, adapters: AdapterRouting, timing: PrefillTiming | None = None
) -> ReplicaFacts:
    """A ready replica as the routing policy sees it: its load here (with the wait a new
    prompt would have there, at `timing`: its profile's, else the cost model's default) and
    its resident adapters."""
    wait = short_wait = None
    if timing is not None:
        wait = tracker.prefill_wait_s(r.replica_id, timing)
        if timing.long_threshold:
            short_wait = tracker.prefill_wait_s(r.replica_id, timing, short=True)
    return ReplicaFacts(
        r.replica_id,
        r.url.rstrip("/"),
        r.version,
        tracker.outstanding(r.replica_id),
        tracker.in_flight(r.replica_id),
        tracker.recently_failed(r.replica_id),
        adapters=adapters.resident(r),
        max_adapters=r.max_adapters,
        prefill_tokens=tracker.queued_prefill(r.replica_id),
        wait_s=wait,
        short_wait_s=short_wait,
        timing=timing,
    )


@dataclass
class Router:
    config: ClusterConfig
    view: ClusterView
    tracker: LoadTracker
    adapters: AdapterRouting
    liveness: PeerLiveness
    peers: PeerAuth
    prefix: PrefixRouting
    queue: ReplicaQueue
    rng: random.Random = field(default_factory=random.Random)
    jurisdiction: Callable[[], str] = lambda: ""  # this cluster's (desired state)

    @property
    def cluster(self) -> str:
        return self.config.cluster

    def plan(self, call: Call) -> Plan:
        """The routing plan on the facts as they are now. A pipeline hop the gateway sends
        to the cluster that runs its pipeline request goes to that peer only."""
        here = self.cluster_facts(call.deployment, continuation=bool(call.info.resume_ids))
        peers = self.live_peers(call.deployment)
        request = self.request_facts(call)
        hop = call.pipeline
        if hop is not None and hop.decision.action == "forward":
            chosen = next((p for p in peers if p.cluster == hop.decision.peer), None)
            return plan_to_peer(request, here, chosen, hop.decision.reason)
        return plan_route(request, here, peers, self.prefix.index, self.prefix.model)

    def request_facts(self, call: Call) -> RequestFacts:
        info = call.info
        return RequestFacts(
            info.deployment,
            info.prompt_tokens,
            info.cost_tokens,
            forwarded=call.forwarded_from is not None,
            draw=call.draw if call.draw is not None else self.rng.random(),
            block_hashes=call.block_keys,
            block_tokens=self.prefix.block_tokens(info.deployment),
            adapter=call.adapter,
            allowed=call.allowed,
            local_only=call.local_only or (call.pipeline is not None and call.pipeline.local_only),
        )

    def continues(self, target: Attempt) -> bool:
        """Whether a stream on `target` can be continued elsewhere, and `target` can take a
        continuation: a replica whose engine speaks Fleet's continuation form (a foreign
        engine's replica does not: its streams are not migrated); a peer decides itself."""
        if target.is_peer:
            return True
        status = next((r for r in self.view.replicas if r.replica_id == target.name), None)
        return status is not None and CAPABILITIES[status.engine].fleet_continuation

    def alive(self, target: Attempt) -> bool:
        """A peer target not heard dead since the plan was made (a replica: always)."""
        return not target.is_peer or self.liveness.alive(target.name)

    async def adapter_ready(self, call: Call, target: Attempt) -> bool:
        """True unless the request names an adapter that could not be loaded on `target`
        (nothing was sent there; the next target is tried)."""
        if call.adapter is None or target.is_peer:
            return True
        status = next((r for r in self.view.replicas if r.replica_id == target.name), None)
        outcome = "failed" if status is None else await self.adapters.ensure(status, call.adapter)
        self.adapters.routed.labels(call.deployment, outcome).inc()
        if outcome != "failed":
            self.adapters.touch(target.name, call.adapter)
        return outcome != "failed"

    def cluster_facts(self, deployment: str, continuation: bool = False) -> ClusterFacts:
        """`continuation`: for a stream continued here (a peer's resume), only replicas whose
        engine can take it."""
        route = self.view.route(deployment)
        ready = [r for r in self.view.ready(deployment) if serves_users(route, r.version)]  # not the shadow
        if continuation:
            ready = [r for r in ready if CAPABILITIES[r.engine].fleet_continuation]
        self.adapters.observe(ready)
        timing = self.prefix.timing(deployment) or self.prefix.model.timing
        replicas = tuple(replica_facts(r, self.tracker, self.adapters, timing) for r in ready)
        host_value = self.prefix.host_token_value(deployment)
        if host_value is not None:
            replicas = tuple(replace(r, host_token_value=host_value) for r in replicas)
        return ClusterFacts(
            self.cluster,
            replicas,
            versions=tuple(route.versions) if route else (),
            standby_here=route is not None
            and any(c.cluster == self.cluster and c.standby for c in route.clusters),
            agent_silent=self.liveness.silent(self.cluster),
            waiting=self.queue.waiting(deployment),
            spill_per_replica=getattr(self.config.gateway, "spill_queue_per_replica", None),
            jurisdiction=self.jurisdiction(),
            coming=self.view.has_replicas(deployment) or (route is not None and route.scale_to_zero),
        )

    def live_peers(self, deployment: str) -> list[PeerFacts]:
        """Peers from the route, nearest first, less those heard dead or just failed, with
        their jurisdictions (the plan keeps the permitted ones, standby peers only while no
        permitted primary is alive)."""
        peers = peer_order(
            self.view.route(deployment), self.cluster, self.config.coordinates, region=self.config.region
        )
        return [
            PeerFacts(
                p.cluster,
                p.gateway_url.rstrip("/"),
                standby=p.standby,
                rtt_s=p.rtt_ms / 1000 if p.rtt_ms is not None else None,
                replica_ids=self.prefix.index.replicas(p.cluster, deployment),
                jurisdiction=p.jurisdiction,
            )
            for p in peers
            if self.liveness.alive(p.cluster) and self.peers.usable(p.gateway_url)
        ]
