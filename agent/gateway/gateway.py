"""The request path: authenticate, validate, pick a target, proxy, account.

Where a request goes is one pure plan (`agent.gateway.plan`: ready replicas here by
cached prefix and load, live peers, standby, spill); this module gathers its facts and
walks its attempts doing the I/O. Failures before the client's first byte are retried
elsewhere; afterwards a stream ends with an in-band error event.

Longer than ~400 lines: the request path is one walk (admission, plan, attempts, stream,
accounting); its policies already live in their own modules (plan, queue, quota, routing,
proxy), and what is left shares the per-request `Exchange` state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agent.adapters import ReplicaAdapters
from agent.gateway.adapters import AdapterRouting
from agent.gateway.auth import Authenticator
from agent.gateway.capacity_metrics import UnschedulableCollector
from agent.gateway.coldstart import ColdStartCollector
from agent.gateway.contract import accounting_usage
from agent.gateway.demand import DemandSignal
from agent.gateway.errors import GatewayError, error_response
from agent.gateway.freshness import KeyFreshness
from agent.gateway.inputs import OFF_LOOP_BYTES, Endpoint, RequestInfo, parse_off_loop
from agent.gateway.limits import QuotaGate
from agent.gateway.liveness import SESSION_HEADER, PeerLiveness, sticky_draw
from agent.gateway.load import LoadTracker
from agent.gateway.metrics import UNKNOWN, GatewayMetrics
from agent.gateway.migration import (
    Leg,
    MigrationMetrics,
    RelayState,
    StreamLedger,
    first_leg_body,
    migratable,
    open_continuation,
    refuse_client_resume,
    relay,
)
from agent.gateway.peers import PeerAuth
from agent.gateway.plan import (
    Attempt,
    ClusterFacts,
    PeerFacts,
    Plan,
    ReplicaFacts,
    RequestFacts,
    plan_failover,
    plan_route,
)
from agent.gateway.prefix import PrefixRouting
from agent.gateway.proxy import AttemptFailed, Deadlines, Opened, make_client, open_upstream
from agent.gateway.queue import ReplicaQueue
from agent.gateway.quota import Reservation
from agent.gateway.routing import HOPS_HEADER, hops_of, peer_order
from agent.gateway.sse import StreamObserver
from agent.gateway.state import ClusterView
from agent.gateway.tenancy import salted_body
from agent.gateway.tokens import DesiredIndex, TokenCounters
from agent.gateway.usage import UsagePublisher
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import GatewayStatus, LocalState
from fleet_base.nats_io import NatsLink
from fleet_base.openai_contract.continuation import TOKEN_IDS_HEADER
from fleet_base.protocol import MAX_USAGE_TOKENS, UsageRecord
from fleet_base.security.tls import nats_tls

log = logging.getLogger("agent.gateway")

FORWARDED_HEADER = "X-Fleet-Forwarded"
REQUEST_ID_HEADER = "X-Request-Id"
PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # status recorded when the client went away (nginx's convention)
QUEUE_HEADER = "X-Fleet-Queue-Seconds"  # time a request waited for a replica slot here


@dataclass
class Exchange:
    """One client request from arrival to its last byte: the telemetry it leaves."""

    request_id: str
    key_id: str
    info: RequestInfo
    started: float
    forwarded_from: str | None
    version: int | None = None
    peer: str | None = None
    ttft_s: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    # quotas and priority
    reservation: Reservation | None = None
    limit_headers: dict[str, str] = field(default_factory=dict)
    klass: str = ""
    admitted: bool = False  # holds a slot of the queue's concurrency target
    queue_s: float = 0.0
    ran: bool = False  # a replica answered 2xx: it may have generated tokens
    draw: float | None = None  # sticky canary draw of the end user
    block_keys: tuple[int, ...] | None = None  # the prompt's prefix-block keys, once computed
    adapter: str | None = None  # the LoRA adapter the request names ("model"), if any

    @property
    def deployment(self) -> str:
        return self.info.deployment


class Gateway:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        nats: bool = True,
        retry_after_s: int = 1,
    ) -> None:
        self.config = config
        self.cluster = config.cluster
        self.view = ClusterView(config.state_dir)
        gwc = config.gateway
        self.freshness = KeyFreshness(
            lambda: self.view.keys_confirmed_at, gwc.key_state_max_age_s, gwc.stale_keys
        )
        self.auth = Authenticator(lambda: self.view.keys, freshness=self.freshness)
        self.tracker = LoadTracker()
        self.metrics = GatewayMetrics(load=self._load_snapshot)
        self.migration_metrics = MigrationMetrics(self.metrics.registry)
        self.adapters = AdapterRouting(self.metrics.registry)
        self.queue = ReplicaQueue(
            self.view, config.gateway.queue_size, config.gateway.queue_timeout_s, self.metrics, retry_after_s
        )
        gwc = config.gateway
        self.desired = DesiredIndex(config.state_dir)
        self.tokens = TokenCounters(self.desired)
        self.quota = QuotaGate(config.cluster, self.metrics, minute_s=gwc.quota_minute_s)
        self.queue.classes = tuple(gwc.priority_classes)
        self.queue.max_age_s = gwc.max_queue_age_s
        self.queue.capacity = self._concurrency_target
        link = (
            NatsLink(
                config.nats_url,
                f"gateway-{config.cluster}",
                tls=nats_tls(config.security, "gateway", config.cluster),
                manage_jetstream=not config.security.enabled,
            )
            if nats and config.nats_url
            else None
        )
        self.usage = UsagePublisher(link, config.cluster, self.metrics)
        self.prefix = PrefixRouting(
            link,
            config.cluster,
            self.metrics,
            routing=gwc.routing,
            tokens_per_s=gwc.prefix_tokens_per_s,
            max_blocks=gwc.prefix_index_blocks,
            engine_arg=self.desired.engine_arg,
            clusters=self._route_clusters,
        )
        # demand for the autoscaler (scale from zero), cold starts on /metrics
        self.demand = DemandSignal(link, config.cluster, ready=lambda d: len(self.view.ready(d)))
        self.queue.cold_start_timeout_s = gwc.cold_start_timeout_s
        self.metrics.registry.register(ColdStartCollector(lambda: self.view.replicas))
        self.metrics.registry.register(UnschedulableCollector(lambda: self.view.replicas))
        self._demand: asyncio.Task[None] | None = None
        self.liveness = PeerLiveness(link)  # clusters heard on NATS: failover faster than routes
        # who forwarded a request; credentials for upstreams
        self.peers = PeerAuth(config, self.metrics.registry)
        self.client: httpx.AsyncClient | None = None
        self.rng = random.Random()
        self._watch: asyncio.Task[None] | None = None
        self._status: asyncio.Task[None] | None = None
        self._seen_reloads: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.client = make_client(verify=self.peers.client_verify)
        self.adapters.api = ReplicaAdapters(self.client, self.peers.replica_headers)
        self._watch = asyncio.create_task(self.view.watch(), name="state-watch")
        self._status = asyncio.create_task(self._status_loop(), name="gateway-status")
        self.usage.start()
        self._demand = asyncio.create_task(self.demand.repeat(), name="gateway-demand")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._status is not None:
            self._status.cancel()
        if self._demand is not None:
            self._demand.cancel()
        await self.usage.close()
        if self.client is not None:
            await self.client.aclose()

    def refresh(self) -> None:
        self.view.refresh()
        changed = False
        for name, count in self.view.reloads.items():
            if count != self._seen_reloads.get(name, 0):
                self.metrics.state_reloads.labels(name).inc(count - self._seen_reloads.get(name, 0))
                self._seen_reloads[name] = count
                changed = True
                if name == "keys":
                    self.quota.prime(list(self.view.keys.values()))
        if changed:
            self.prefix.index.keep_only(self.cluster, [r.replica_id for r in self.view.replicas])
            for deployment in self.view.deployments():
                route = self.view.route(deployment)
                peers = [c.cluster for c in route.clusters if c.cluster != self.cluster] if route else []
                self.metrics.know(deployment, peers)
                self.migration_metrics.know(deployment)
                self.adapters.know(deployment)

    def _route_clusters(self) -> set[str]:
        """This cluster and every cluster its routes name (whose KV events it indexes)."""
        out = {self.cluster}
        for deployment in self.view.deployments():
            route = self.view.route(deployment)
            if route is not None:
                out.update(c.cluster for c in route.clusters)
        return out

    def _concurrency_target(self, deployment: str) -> int:
        """Requests this gateway lets run at once on the deployment's ready replicas."""
        gwc = self.config.gateway
        per = gwc.concurrency_targets.get(deployment)
        if per is None:
            seqs = self.desired.engine_arg(deployment, "max_num_seqs")
            per = seqs if isinstance(seqs, int) and seqs > 0 else gwc.concurrency_target
        return per * len(self.view.ready(deployment))

    async def _status_loop(self, interval_s: float = 0.5) -> None:
        """Tell the agent the queue depth (gateway.json, for its heartbeat), each interval."""
        local = LocalState(self.config.state_dir)
        while True:
            by_class = {c: self.queue.class_depth(c) for c in self.queue.classes}
            status = GatewayStatus(queue_depth=self.queue.depth, by_class=by_class)
            try:
                await asyncio.to_thread(local.save_gateway, status)
            except OSError as err:
                log.warning("cannot write %s: %s", local.gateway_path, err)
            await asyncio.sleep(interval_s)

    def _load_snapshot(self) -> dict[str, tuple[str, int, int]]:
        deployments = {r.replica_id: r.deployment for r in self.view.replicas}
        return {
            rid: (deployments.get(rid, UNKNOWN), tokens, requests)
            for rid, (tokens, requests) in self.tracker.snapshot().items()
        }

    # ------------------------------------------------------------------ small endpoints

    def health(self) -> dict[str, Any]:
        self.refresh()
        ready: dict[str, int] = {}
        for r in self.view.replicas:
            if r in self.view.ready(r.deployment):
                ready[r.deployment] = ready.get(r.deployment, 0) + 1
        return {
            "status": "ok",
            "cluster": self.cluster,
            "ready_replicas": ready,
            "routes": sorted(self.view.routes),
            "queue_depth": self.queue.depth,
            "nats_connected": bool(self.usage.link and self.usage.link.is_connected),
            "state": {name: ":".join(map(str, sig)) for name, sig in self.view.signatures.items()},
        }

    def models(self, request: Request) -> Response:
        self.refresh()
        try:
            record = self.auth.authenticate(request.headers.get("authorization"))
            self.auth.authorize(record)
        except GatewayError as err:
            return error_response(err)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "fleet"}
            for name in self.view.deployments()
            if record.allows(name)
        ]
        data += [
            {"id": name, "object": "model", "created": 0, "owned_by": "fleet", "parent": dep}
            for name, dep in sorted(self.adapters.catalog(self.view.replicas).items())
            if record.allows(dep)
        ]
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------------ inference

    async def inference(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"req-{secrets.token_hex(12)}"
        reply_headers = {REQUEST_ID_HEADER: request_id, "X-Fleet-Cluster": self.cluster}
        self.refresh()
        record: ApiKeyRecord | None = None
        try:
            record = self.auth.authenticate(request.headers.get("authorization"))
            self.auth.authorize(record)
            raw = await self._read_body(request)
            info = await parse_off_loop(raw, endpoint)
            adapter, info = self._adapter_of(info)
            self.auth.authorize(record, info.deployment)
            if not self.view.known(info.deployment):
                raise GatewayError(
                    404,
                    f"The model '{info.deployment}' does not exist (see GET /v1/models)",
                    param="model",
                    code="model_not_found",
                )
            info, counter = await self.tokens.recount_async(info, off_loop=len(raw) > OFF_LOOP_BYTES)
            self.metrics.prompt_tokens_counted.labels(info.deployment, counter).inc(info.prompt_tokens)
        except GatewayError as err:
            self._count(UNKNOWN, err.status, started)
            if record is not None:  # a key with limits sees them on every answer
                reply_headers.update(self.quota.headers(record, ""))
            return error_response(err, reply_headers)
        try:
            reservation, limit_headers = self.quota.admit(
                record, info, info.worst_case_tokens(self._context_tokens(info.deployment)), adapter
            )
        except GatewayError as err:  # over a quota: the refusal is demand the control plane sees
            self._count(info.deployment, err.status, started)
            self.usage.submit(
                UsageRecord(
                    cluster=self.cluster,
                    key_id=record.key_id,
                    deployment=info.deployment,
                    status=err.status,
                    refused_tokens=min(info.cost_tokens, MAX_USAGE_TOKENS),
                    latency_s=time.monotonic() - started,
                    adapter=adapter,
                )
            )
            return error_response(err, reply_headers)
        origin = self.peers.origin(request.scope, request.headers, FORWARDED_HEADER)
        ex = Exchange(request_id, record.key_id, info, started, origin, adapter=adapter)
        ex.reservation, ex.limit_headers = reservation, limit_headers
        ex.klass = record.quotas.priority_class or self.config.gateway.default_class
        reply_headers.update(limit_headers)
        self.metrics.in_flight.labels(info.deployment).inc()
        try:
            response = await _unless_disconnected(request, self._serve(ex, raw, request))
        except GatewayError as err:
            self._finish(ex, err.status)
            return error_response(err, reply_headers)
        except _ClientGone:
            self._finish(ex, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            self._finish(ex, 500)
            raise
        response.headers[REQUEST_ID_HEADER] = request_id
        response.headers.setdefault("X-Fleet-Cluster", self.cluster)  # a peer's answer keeps its own
        if ex.version is not None:
            response.headers.setdefault("X-Fleet-Version", str(ex.version))  # which version answered
        if ex.admitted:
            response.headers[QUEUE_HEADER] = f"{ex.queue_s:.4f}"
        if ex.peer is None:  # a peer's answer carries the peer's limits
            for name, value in ex.limit_headers.items():
                response.headers[name] = value
        return response

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.gateway.max_body_bytes
        too_large = GatewayError(
            413,
            f"Request body is larger than this gateway's limit of {limit} bytes",
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
        return b"".join(parts)

    async def _serve(self, ex: Exchange, raw: bytes, request: Request) -> Response:
        """Walk the routing plan's stages (agent.gateway.plan) doing the I/O."""
        deployment = ex.deployment
        refuse_client_resume(ex.info, ex.forwarded_from is not None)
        ex.draw = sticky_draw(ex.info.body, request.headers)
        if ex.draw is None:  # the canary split is drawn once per request, re-plans included
            ex.draw = self.rng.random()
        plan = self._plan(ex)
        for stage in plan.stages:
            attempts = plan.stage(stage)
            if stage in ("primary", "peer-prefix"):
                # A warm standby serves only while no primary is alive; a peer
                # holding the prefix is worth a try. Either way, a failure serves here.
                try:
                    response = await self._attempts(ex, raw, request, attempts, pass_failure=False)
                except GatewayError:  # nobody answered: serve here (charged here)
                    if stage == "primary":  # no primary answered: skip them for a while
                        for target in attempts:
                            self.liveness.mark_down(target.name)
                else:
                    self.quota.refund(ex.reservation)  # the peer's gateway charged the key
                    return response
            elif stage == "peer":
                self.quota.refund(ex.reservation)
                return await self._attempts(ex, raw, request, attempts)
            elif stage == "local":
                with self._waiting(deployment):
                    ex.queue_s = await self.queue.admit(deployment, ex.klass)
                ex.admitted = True
                if ex.queue_s > 0 or not attempts[0].name:  # waited: choose on fresh load
                    attempts = self._plan(ex).stage("local")
                try:
                    body = salted_body(ex.info, raw, ex.key_id)  # prefix cache hits never cross keys
                    return await self._attempts(ex, body, request, attempts)
                except GatewayError as err:
                    # Every local attempt failed before a byte (dead replicas, a dead cluster):
                    # the peers alive now (a primary that just failed is not).
                    facts = self._facts(ex)
                    failover = plan_failover(facts, self._live_peers(deployment), self.prefix.index)
                    if not failover or err.status not in (502, 503):
                        raise
                    self.quota.refund(ex.reservation)
                    return await self._attempts(ex, raw, request, failover)
        raise self.queue.unavailable(deployment, "no replica or peer can serve it")

    def _waiting(self, deployment: str) -> contextlib.AbstractContextManager[None]:
        """Counts the request as demand while it waits for a replica slot."""
        if not self.queue.would_wait(deployment):
            return contextlib.nullcontext()
        return self.demand.waiting(deployment, len(self.view.ready(deployment)))

    def _plan(self, ex: Exchange) -> Plan:
        """The routing plan on the facts as they are now (agent.gateway.plan)."""
        here = self._cluster_facts(ex.deployment)
        peers = self._live_peers(ex.deployment)
        return plan_route(self._facts(ex), here, peers, self.prefix.index, self.prefix.model)

    def _facts(self, ex: Exchange) -> RequestFacts:
        info = ex.info
        return RequestFacts(
            info.deployment,
            info.prompt_tokens,
            info.cost_tokens,
            forwarded=ex.forwarded_from is not None,
            draw=ex.draw if ex.draw is not None else self.rng.random(),
            block_hashes=self.prefix.keys(ex),
            block_tokens=self.prefix.block_tokens(info.deployment),
            adapter=ex.adapter,
        )

    def _adapter_of(self, info: RequestInfo) -> tuple[str | None, RequestInfo]:
        """A `model` that names a LoRA adapter here: (the adapter, the request as its
        deployment's); anything else is left as it is."""
        if self.view.known(info.deployment):
            return None, info
        owner = self.adapters.resolve(self.view.replicas, info.deployment)
        if owner is None:
            return None, info
        return info.deployment, replace(info, deployment=owner)

    async def _usable(self, ex: Exchange, targets: list[Attempt]) -> AsyncIterator[tuple[int, Attempt]]:
        """The attempts in order, numbered, less replicas where the request's LoRA adapter
        could not be loaded (nothing was sent there; the next one is tried)."""
        n = 0
        for target in targets:
            if not target.name or not await self.adapter_ready(ex, target):
                continue
            yield n, target
            n += 1

    async def adapter_ready(self, ex: Exchange, target: Attempt) -> bool:
        """True unless the request names an adapter that could not be loaded on `target`."""
        if ex.adapter is None or target.is_peer:
            return True
        return await self._ensure_adapter(ex, target)

    async def _ensure_adapter(self, ex: Exchange, target: Attempt) -> bool:
        """Load the request's adapter on the chosen replica if it is not resident there."""
        assert ex.adapter is not None
        status = next((r for r in self.view.replicas if r.replica_id == target.name), None)
        outcome = "failed" if status is None else await self.adapters.ensure(status, ex.adapter)
        self.adapters.routed.labels(ex.deployment, outcome).inc()
        if outcome != "failed":
            self.adapters.touch(target.name, ex.adapter)
        return outcome != "failed"

    def _cluster_facts(self, deployment: str) -> ClusterFacts:
        route = self.view.route(deployment)
        ready = self.view.ready(deployment)
        self.adapters.observe(ready)
        replicas = tuple(
            ReplicaFacts(
                r.replica_id,
                r.url.rstrip("/"),
                r.version,
                self.tracker.outstanding(r.replica_id),
                self.tracker.in_flight(r.replica_id),
                self.tracker.recently_failed(r.replica_id),
                adapters=self.adapters.resident(r),
                max_adapters=r.max_adapters,
            )
            for r in ready
        )
        return ClusterFacts(
            self.cluster,
            replicas,
            versions=tuple(route.versions) if route else (),
            standby_here=route is not None
            and any(c.cluster == self.cluster and c.standby for c in route.clusters),
            agent_silent=self.liveness.silent(self.cluster),
            waiting=self.queue.waiting(deployment),
            spill_per_replica=getattr(self.config.gateway, "spill_queue_per_replica", None),
        )

    def _live_peers(self, deployment: str) -> list[PeerFacts]:
        """Peers from the route, nearest first, less those heard dead or just failed;
        standby peers only while no primary peer is alive."""
        peers = peer_order(
            self.view.route(deployment), self.cluster, self.config.coordinates, region=self.config.region
        )
        live = [
            PeerFacts(
                p.cluster,
                p.gateway_url.rstrip("/"),
                standby=p.standby,
                rtt_s=p.rtt_ms / 1000 if p.rtt_ms is not None else None,
                replica_ids=self.prefix.index.replicas(p.cluster, deployment),
            )
            for p in peers
            if self.liveness.alive(p.cluster) and self.peers.usable(p.gateway_url)
        ]
        return [t for t in live if not t.standby] or live

    async def _attempts(
        self,
        ex: Exchange,
        body: bytes,
        request: Request,
        targets: list[Attempt],
        pass_failure: bool = True,
    ) -> Response:
        """Try a target; on a failure before the first byte, once more on another one (twice
        more when every failure so far was work never started: a refused connection or a
        503 from a replica shutting down, as when a rollout or failover moves replicas)."""
        assert self.client is not None
        deployment = ex.deployment
        path = PATHS[ex.info.endpoint]
        failure: AttemptFailed | None = None
        unstarted = True  # every failure so far: nothing ran there
        async for attempt, target in self._usable(ex, targets):
            if attempt == 2 and not unstarted:
                break
            if attempt:
                self.metrics.retries.labels(deployment).inc()
            headers = self._upstream_headers(ex, target, request)
            self.prefix.count(ex, target)
            opened: Opened | None = None
            try:
                opened = await open_upstream(
                    self.client, target.url + path, headers, body, self._deadlines(ex, target)
                )
                if opened.status >= 300 or not ex.info.stream:
                    data = await opened.read_rest()
            except AttemptFailed as err:
                log.warning(
                    "request %s: %s %s failed: %s",
                    ex.request_id,
                    "peer" if target.is_peer else "replica",
                    target.name,
                    err,
                )
                self.metrics.upstream_errors.labels(deployment, err.reason).inc()
                if not target.is_peer:
                    self.tracker.finish(target.name, self._work(ex, target))
                    self.tracker.mark_failed(target.name)
                unstarted = unstarted and err.status in (None, 503) and err.reason != "read"
                if target.is_peer and err.status is None:
                    self.liveness.mark_down(target.name)
                if not target.is_peer and err.status is not None and err.status != 503:
                    self._attempt_failed(ex, target, err.status)  # a 503 is a replica shutting down
                failure = err
                continue
            except BaseException:  # cancelled (the client left) or a bug: release everything
                if opened is not None:
                    await opened.close()
                if not target.is_peer:
                    self.tracker.finish(target.name, self._work(ex, target))
                raise
            ex.version, ex.peer = target.version, (target.name if target.is_peer else None)
            ex.ran = not target.is_peer and 200 <= opened.status < 300
            if opened.status >= 300 or not ex.info.stream:
                self._release(ex, target)
                return self._whole(ex, opened, data)
            return self._stream(ex, opened, target, request)
        if failure is not None and failure.status is not None and pass_failure:
            self._finish(ex, failure.status)
            return Response(failure.body, status_code=failure.status, headers=failure.headers)
        if failure is not None:
            raise GatewayError(
                502,
                f"The upstream serving '{deployment}' failed before responding ({failure.detail}); retry the request",
                code="upstream_failed",
                headers={"Retry-After": str(self.queue.retry_after_s)},
            )
        raise self.queue.unavailable(deployment, "its replicas went away")

    def _upstream_headers(self, ex: Exchange, target: Attempt, request: Request) -> dict[str, str]:
        """Headers of one attempt (counted as started: load, forwarding metrics)."""
        deployment = ex.deployment
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: ex.request_id}
        if migratable(ex.info):  # the replica's chunks carry token ids for a migration
            headers[TOKEN_IDS_HEADER] = "1"
        if target.is_peer:
            headers["authorization"] = request.headers.get("authorization", "")
            headers[FORWARDED_HEADER] = self.cluster
            if request.headers.get(SESSION_HEADER):  # the peer keeps the user's canary side
                headers[SESSION_HEADER] = request.headers[SESSION_HEADER]
            headers[HOPS_HEADER] = str(hops_of(self.peers.hops(ex.forwarded_from, request.headers)) + 1)
            headers.update(self.peers.to_peer(target.name, ex.request_id))
            self.metrics.forwarded.labels(deployment, target.name).inc()
        else:
            headers.update(self.peers.replica_headers)
            self.tracker.start(target.name, self._work(ex, target))
            self.metrics.replica_choice.labels(deployment, target.name, str(target.version)).inc()
        return headers

    @staticmethod
    def _work(ex: Exchange, target: Attempt) -> int:
        """Queued work a request adds at a replica: its new prefill and reserved completion."""
        return max(0, ex.info.cost_tokens - target.cached_tokens)

    def _context_tokens(self, deployment: str) -> int:
        """The deployment's context window: its engine_args max_model_len, else the setting."""
        value = self.desired.engine_arg(deployment, "max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return self.config.gateway.default_context_tokens

    def _deadlines(self, ex: Exchange, target: Attempt) -> Deadlines:
        gwc = self.config.gateway
        first = gwc.first_byte_timeout_s + (gwc.queue_timeout_s if target.is_peer else 0.0)
        if not ex.info.stream:  # the first byte comes with the whole answer
            first += gwc.token_timeout_s * ex.info.max_tokens * ex.info.sequences
        return Deadlines(first_byte_s=first, gap_s=gwc.inter_chunk_timeout_s)

    def _release(self, ex: Exchange, target: Attempt) -> None:
        if not target.is_peer:
            self.tracker.finish(target.name, self._work(ex, target))

    def _whole(self, ex: Exchange, opened: Opened, data: bytes) -> Response:
        if 200 <= opened.status < 300:
            try:
                usage = json.loads(data).get("usage")
            except (ValueError, AttributeError):
                usage = None
            if isinstance(usage, dict):
                ex.usage = accounting_usage(ex.info.endpoint, usage)
        self._finish(ex, opened.status)
        return Response(data, status_code=opened.status, headers=opened.headers())

    def _stream(self, ex: Exchange, opened: Opened, target: Attempt, request: Request) -> Response:  # noqa: C901 - one stream with its migration and cleanup paths
        observer = StreamObserver(strip_usage=not target.is_peer and not ex.info.client_wants_usage)
        keep_ids = ex.forwarded_from is not None and bool(request.headers.get(TOKEN_IDS_HEADER))
        ledger = StreamLedger.of(ex.info, keep_ids)
        state = RelayState(Leg(opened, target.name, target.is_peer), opened.status)
        targets = {target.name: target}
        closed = False

        async def release(leg: Leg, failed: bool) -> None:
            await leg.opened.close()
            if failed:
                self.metrics.upstream_errors.labels(ex.deployment, "midstream").inc()
            if not leg.is_peer:
                self._release(ex, targets[leg.name])
                if failed:
                    self.tracker.mark_failed(leg.name)

        async def reopen(make_body: Callable[[bool], bytes], failed: list[str]) -> Leg | None:
            return await open_continuation(self, ex, request, make_body, failed, targets)

        async def cleanup(status: int) -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            await release(state.leg, False)
            if observer.usage:
                ex.usage = accounting_usage(ex.info.endpoint, observer.usage)
            elif not state.leg.is_peer and 200 <= opened.status < 300:
                # cut short (the client left, the upstream broke): charge what was streamed
                ex.usage = {"prompt_tokens": ex.info.prompt_tokens, "completion_tokens": observer.tokens_seen}
            self._finish(ex, status)

        def on_event() -> None:
            if observer.first_token and ex.ttft_s is None:
                ex.ttft_s = time.monotonic() - ex.started

        def log_failure(name: str, err: Exception) -> None:
            log.warning("request %s: stream from %s broke: %s", ex.request_id, name, err)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for out in relay(
                    state,
                    ledger,
                    observer,
                    deployment=ex.deployment,
                    limit=self.config.gateway.migration_limit if migratable(ex.info) else 0,
                    prompt_tokens=ex.info.prompt_tokens,
                    body_for=lambda is_peer: first_leg_body(ex.info, ex.key_id, is_peer),
                    reopen=reopen,
                    release=release,
                    metrics=self.migration_metrics,
                    on_event=on_event,
                    log_failure=log_failure,
                ):
                    yield out
            except BaseException:
                state.status = CLIENT_CLOSED
                raise
            finally:
                await cleanup(state.status)

        return _ProxiedStream(
            body(),
            cleanup,
            status_code=opened.status,
            headers={**opened.headers(), **SSE_HEADERS},
        )

    # ------------------------------------------------------------------ telemetry

    def _count(self, deployment: str, status: int, started: float) -> None:
        self.metrics.requests.labels(deployment, str(status)).inc()
        self.metrics.duration.labels(deployment).observe(time.monotonic() - started)

    def _attempt_failed(self, ex: Exchange, target: Attempt, status: int) -> None:
        """Telemetry of a replica attempt that failed and was retried: rollouts judge the
        version that failed, not the one that answered in the end."""
        self.usage.submit(
            UsageRecord(
                cluster=self.cluster,
                key_id=ex.key_id,
                deployment=ex.deployment,
                version=target.version,
                status=status,
                latency_s=time.monotonic() - ex.started,
                attempt_failed=True,
            )
        )

    def _finish(self, ex: Exchange, status: int) -> None:
        """Account one request exactly once: metrics always; a usage record when it was
        served (or refused) here, not when a peer served it (the peer records it)."""
        if ex.finished:
            return
        ex.finished = True
        deployment = ex.deployment
        if ex.admitted:
            self.queue.release(deployment)
        self.quota.settle(ex.reservation, ex.usage, ex.ran)
        latency = time.monotonic() - ex.started
        self.metrics.in_flight.labels(deployment).dec()
        self._count(deployment, status, ex.started)
        if ex.ttft_s is not None:
            self.metrics.ttft.labels(deployment).observe(ex.ttft_s)
        if ex.peer is not None:
            return
        prompt = _int(ex.usage.get("prompt_tokens"))
        completion = _int(ex.usage.get("completion_tokens"))
        if prompt:
            self.metrics.tokens.labels(deployment, "prompt").inc(prompt)
        if completion:
            self.metrics.tokens.labels(deployment, "completion").inc(completion)
        self.usage.submit(
            UsageRecord(
                cluster=self.cluster,
                key_id=ex.key_id,
                deployment=deployment,
                version=ex.version,
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                ttft_s=ex.ttft_s,
                latency_s=latency,
                adapter=ex.adapter,
            )
        )


def _int(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return min(value, MAX_USAGE_TOKENS) if ok else 0


class _ProxiedStream(StreamingResponse):
    """A streamed upstream response that is cleaned up however it ends: fully sent, cut
    by the client, or never started (a disconnect before the first send)."""

    def __init__(
        self, content: AsyncIterator[bytes], cleanup: Callable[[int], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def abandon(self) -> None:
        await _aclose(self.body_iterator)
        await self._cleanup(CLIENT_CLOSED)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.abandon()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work` (queueing, first attempt) but give up when the client disconnects, so a
    caller that went away neither holds a queue slot nor keeps a replica generating."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    try:
        response = await task
    except (asyncio.CancelledError, Exception):
        raise _ClientGone() from None
    # finished in the same instant: drop it (its stream, if any, is never sent)
    if isinstance(response, _ProxiedStream):
        await response.abandon()
    raise _ClientGone()


async def _aclose(iterator: Any) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()
