"""The gateway's shell: wires its parts and admits each request.

A request's walk: `inference` authenticates, reads and parses the body once into a typed
request (`agent.gateway.inputs`), admits it against the key's quotas (`limits`), and makes
the `Exchange` (`agent.gateway.exchange`); `Dispatcher` (`dispatch`) walks the routing
plan (`plan`, facts from `router`) through the one upstream opener (`upstream`); a stream
is relayed and migrated by `stream`/`migration`; `Accounting` books its end once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from agent.adapters import ReplicaAdapters, replica_cache_root
from agent.engine_kv_snapshot import load as engine_kv_snapshot
from agent.gateway.accounting import CLIENT_CLOSED, Accounting
from agent.gateway.adapters import AdapterRouting
from agent.gateway.auth import Authenticator
from agent.gateway.batch.metrics import LineMetrics
from agent.gateway.batch.service import BatchService, gateway_hooks, open_nats_store
from agent.gateway.batch.spare import Spare, spare_lines
from agent.gateway.batch.work import ENDPOINTS, WorkOutcome, whole_body
from agent.gateway.batch.worker import BatchWorker, WorkerHooks
from agent.gateway.capacity_metrics import UnschedulableCollector
from agent.gateway.coldstart import ColdStartCollector
from agent.gateway.demand import DemandSignal
from agent.gateway.disconnect import ClientGone, unless_disconnected
from agent.gateway.dispatch import Dispatcher
from agent.gateway.engine_gate import refusal
from agent.gateway.engine_kv_metrics import EngineKvEventsCollector
from agent.gateway.errors import GatewayError, error_response
from agent.gateway.exchange import Call, ClientHeaders, Exchange, Settlement
from agent.gateway.fence_metrics import FencedWritesCollector
from agent.gateway.freshness import KeyFreshness
from agent.gateway.inputs import OFF_LOOP_BYTES, Endpoint, RequestInfo, parse_off_loop, read_body
from agent.gateway.limits import QuotaGate
from agent.gateway.liveness import SESSION_HEADER, PeerLiveness, sticky_draw
from agent.gateway.load import LoadTracker
from agent.gateway.metrics import UNKNOWN, GatewayMetrics
from agent.gateway.migration import MigrationMetrics
from agent.gateway.nats_metrics import NatsRefusals
from agent.gateway.node_metrics import NodeHealthCollector
from agent.gateway.peers import PeerAuth, PeerForward
from agent.gateway.pipelines import PipelineRouting
from agent.gateway.prefix import PrefixRouting
from agent.gateway.proxy import make_client
from agent.gateway.queue import ReplicaQueue
from agent.gateway.residency import ResidencyGate
from agent.gateway.router import Router
from agent.gateway.shadow import ShadowMirror
from agent.gateway.shadow_policy import serves_users
from agent.gateway.spans import RequestTrace
from agent.gateway.state import ClusterView
from agent.gateway.tokens import DesiredIndex, TokenCounters
from agent.gateway.upstream import REQUEST_ID_HEADER, Upstreams
from agent.gateway.usage import UsagePublisher
from agent.health.snapshot import load as node_snapshot
from fleet_base import tracing
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.models import WorkItem
from fleet_base.batch.names import usage_record_id
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES
from fleet_base.local_state import LocalState
from fleet_base.models import ModelCache
from fleet_base.nats_io import NatsLink
from fleet_base.openai_contract.continuation import TOKEN_IDS_HEADER
from fleet_base.openai_contract.priority import BATCH_CLASS
from fleet_base.openai_contract.timing import ttft_header
from fleet_base.pipelines import PIPELINE_HEADER, PIPELINE_REQUEST_HEADER
from fleet_base.protocol import UsageRecord
from fleet_base.security.tls import nats_tls
from fleet_base.subjects import permits

log = logging.getLogger("agent.gateway")

QUEUE_HEADER = "X-Fleet-Queue-Seconds"  # time a request waited for a replica slot here


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
        self.residency = ResidencyGate(self.desired.jurisdiction, self.metrics.registry, retry_after_s)
        self.quota = QuotaGate(config.cluster, self.metrics, minute_s=gwc.quota_minute_s)
        self.queue.classes = tuple(gwc.priority_classes)
        self.queue.max_age_s = gwc.max_queue_age_s
        self.queue.key_share = gwc.queue_share_per_key
        self.queue.capacity = self._concurrency_target
        link = (
            NatsLink(
                config.nats_url,
                f"gateway-{config.cluster}",
                tls=nats_tls(config.security, "gateway", config.cluster),
                manage_jetstream=not config.security.enabled,
                permits=permits("gateway", config.cluster),
            )
            if nats and config.nats_url
            else None
        )
        self.usage = UsagePublisher(link, config.cluster, self.metrics)
        if link is not None:
            self.metrics.registry.register(NatsRefusals(link))
        self.prefix = PrefixRouting(
            link,
            config.cluster,
            self.metrics,
            routing=gwc.routing,
            tokens_per_s=gwc.prefix_tokens_per_s,
            max_blocks=gwc.prefix_index_blocks,
            max_cluster_replicas=gwc.prefix_index_cluster_replicas,
            max_cluster_blocks=gwc.prefix_index_cluster_blocks,
            events_per_s=gwc.kv_events_per_s,
            event_bytes_per_s=gwc.kv_events_bytes_per_s,
            engine_arg=self.desired.engine_arg,
            clusters=self._route_clusters,
        )
        # demand for the autoscaler (scale from zero), cold starts on /metrics
        self.demand = DemandSignal(link, config.cluster, ready=lambda d: len(self.view.ready(d)))
        self.queue.cold_start_timeout_s = gwc.cold_start_timeout_s
        self.metrics.registry.register(ColdStartCollector(lambda: self.view.replicas))
        self.metrics.registry.register(UnschedulableCollector(lambda: self.view.replicas))
        nodes = LocalState(config.state_dir)
        self.metrics.registry.register(NodeHealthCollector(lambda: node_snapshot(nodes)))
        self.metrics.registry.register(FencedWritesCollector(nodes.load_fence))
        self.metrics.registry.register(EngineKvEventsCollector(lambda: engine_kv_snapshot(nodes)))
        self._demand: asyncio.Task[None] | None = None
        self.liveness = PeerLiveness(link)  # clusters heard on NATS: failover faster than routes
        # who forwarded a request; credentials for upstreams
        self.peers = PeerAuth(config, self.metrics.registry)
        self.router = Router(
            config, self.view, self.tracker, self.adapters, self.liveness, self.peers, self.prefix, self.queue
        )
        self.router.jurisdiction = self.desired.jurisdiction
        self.pipelines = PipelineRouting(config.cluster, self.router, self.metrics.registry, retry_after_s)
        self.upstreams = Upstreams(config.cluster, gwc, self.peers, self.tracker, self.metrics)
        self.upstreams.residency = self.residency
        self.accounting = Accounting(config.cluster, self.metrics, self.usage, self.queue)
        self.accounting.where = lambda: (config.region, self.desired.jurisdiction())
        self.accounting.hop_finished = self.pipelines.finished
        self.dispatch = Dispatcher(
            gwc,
            self.router,
            self.upstreams,
            self.accounting,
            self.queue,
            self.demand,
            self.migration_metrics,
            self.residency,
        )
        self.shadow = ShadowMirror(
            view=self.view,
            tracker=self.tracker,
            adapters=self.adapters,
            accounting=self.accounting,
            settings=gwc,
            registry=self.metrics.registry,
            slots=self._per_replica,
            jurisdiction=self.desired.jurisdiction,
            replica_headers=lambda: self.peers.replica_headers,
            tokenizer=self.tokens.tokenizer,
        )
        self.dispatch.shadow = self.shadow
        # the Files and Batches API and the batch loops, on the store in this NATS
        self.batch: BatchService | None = None
        self.worker: BatchWorker | None = None
        if config.batch.enabled and link is not None:
            self.batch = BatchService(
                config.batch, gateway_hooks(self), open_store=lambda: open_nats_store(link, config.batch)
            )
            self.worker = BatchWorker(config.batch, self.worker_hooks(), LineMetrics(self.metrics.registry))
            self.batch.loops.append(self.worker.run)
        self._watch: asyncio.Task[None] | None = None
        self._status: asyncio.Task[None] | None = None
        self._seen_reloads: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        client = self.upstreams.client = self.shadow.client = make_client(verify=self.peers.client_verify)
        cache = ModelCache(self.config.model_cache_dir, self.config.model_cache_max_bytes)
        self.adapters.api = ReplicaAdapters(
            client, self.peers.replica_headers, cache, replica_cache_root(self.config)
        )
        self._watch = asyncio.create_task(self.view.watch(), name="state-watch")
        self._status = asyncio.create_task(
            self.queue.report(LocalState(self.config.state_dir)), name="gateway-status"
        )
        self.usage.start()
        self._demand = asyncio.create_task(self.demand.repeat(), name="gateway-demand")
        if self.batch is not None:
            await self.batch.start()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._status is not None:
            self._status.cancel()
        if self._demand is not None:
            self._demand.cancel()
        if self.batch is not None:
            await self.batch.stop()
        await self.shadow.close()
        await self.usage.close()
        if self.upstreams.client is not None:
            await self.upstreams.client.aclose()

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
            live = {r.replica_id for r in self.view.replicas}
            self.prefix.index.keep_only(self.cluster, list(live))
            self.prefix.keep_replicas(live)
            self.metrics.keep_replicas(live)
            self.tracker.keep_only(live)
            for deployment in self.view.deployments():
                route = self.view.route(deployment)
                peers = [c.cluster for c in route.clusters if c.cluster != self.cluster] if route else []
                self.metrics.know(deployment, peers)
                self.migration_metrics.know(deployment)
                self.shadow.metrics.know(deployment)
                self.adapters.know(deployment)

    def worker_hooks(self) -> WorkerHooks:
        """The batch worker's view of this gateway: its request path, the deployments it
        serves, their spare capacity here, and where their backlog goes (demand)."""

        def spare(deployment: str, in_flight: int) -> Spare:
            self.refresh()
            route = self.view.route(deployment)
            ready = [r for r in self.view.ready(deployment) if serves_users(route, r.version)]
            return spare_lines(
                [r.load for r in ready], in_flight, self.queue.waiting(deployment), self.config.batch
            )

        return WorkerHooks(
            run=self.run_work,
            deployments=lambda: (self.refresh(), self.view.deployments())[1],
            spare=spare,
            backlog=self.demand.backlog,
            cluster=self.cluster,
            book=lambda record: self.usage.submit(record),
        )

    def _route_clusters(self) -> set[str]:
        """This cluster and every cluster its routes name (whose KV events it indexes)."""
        out = {self.cluster}
        for deployment in self.view.deployments():
            route = self.view.route(deployment)
            if route is not None:
                out.update(c.cluster for c in route.clusters)
        return out

    def _per_replica(self, deployment: str) -> int:
        """Requests this gateway lets run at once on one ready replica of the deployment."""
        gwc = self.config.gateway
        per = gwc.concurrency_targets.get(deployment)
        if per is None:
            seqs = self.desired.engine_arg(deployment, "max_num_seqs")
            per = seqs if isinstance(seqs, int) and seqs > 0 else gwc.concurrency_target
        return per

    def _concurrency_target(self, deployment: str) -> int:
        """Requests this gateway lets run at once on the deployment's ready replicas that
        serve users (a shadow version's take only copies)."""
        route = self.view.route(deployment)
        serving = [r for r in self.view.ready(deployment) if serves_users(route, r.version)]
        return self._per_replica(deployment) * len(serving)

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
        trace = RequestTrace.begin(request_id, self.cluster, request.headers, endpoint)
        self.refresh()
        record: ApiKeyRecord | None = None
        try:
            with trace.step("gateway.auth") as span:
                forward = self.peers.forward(request.scope, request.headers)
                record = self.peers.key(self.auth, forward, request.headers.get("authorization"))
                tracing.set_attributes(span, {tracing.KEY_ID: record.key_id})
                self.auth.authorize(record)
                self.residency.admit_key(record)  # before any work: a bound key's endpoint is inside
            if forward is not None:
                trace.set({"fleet.forwarded_from": forward.cluster, "fleet.hops": forward.hops})
            call = await self._call(request, request_id, record, endpoint, started, forward, trace)
        except GatewayError as err:
            self.accounting.count(UNKNOWN, err.status, started)
            trace.finish(err.status, key_id=record.key_id if record else None, reason=err.code)
            if record is not None:  # a key with limits sees them on every answer
                reply_headers.update(self.quota.headers(record, ""))
            return error_response(err, reply_headers)
        except BaseException as err:  # the client left while its body was read, or a bug
            gone = isinstance(err, (ClientDisconnect, asyncio.CancelledError))
            trace.finish(CLIENT_CLOSED if gone else 500, reason=type(err).__name__)
            raise
        response, _ = await self._serve(
            call, record, reply_headers, lambda work: unless_disconnected(request, work)
        )
        return response

    async def run_work(self, item: WorkItem, request_id: str) -> WorkOutcome:
        """A batch line or async request run as its owner key, as `inference` runs a
        request (parse, authorize, residency, quota, routing, usage) but in the `batch`
        class, whole (never streamed), served here only (a peer's own workers take the
        deployment's items when it has room), its usage record marked batch under the
        line's own id. A key gone or revoked since the item was queued fails the line."""
        started = time.monotonic()
        trace = RequestTrace(request_id, self.cluster)
        reply_headers = {REQUEST_ID_HEADER: request_id, "X-Fleet-Cluster": self.cluster}
        self.refresh()
        record = self.view.keys.get(item.key_id)
        try:
            if record is None or record.revoked:
                raise GatewayError(
                    401, f"The API key '{item.key_id}' is unknown or revoked", code="invalid_api_key"
                )
            self.auth.authorize(record)
            self.residency.admit_key(record)
            raw = json.dumps(whole_body(item.body)).encode()
            call = await self._call_of(
                raw, request_id, record, ENDPOINTS[item.endpoint], started, None, {}, trace
            )
        except GatewayError as err:
            self.accounting.count(UNKNOWN, err.status, started)
            trace.finish(err.status, key_id=item.key_id, reason=err.code)
            return WorkOutcome.of(error_response(err, reply_headers))
        held: list[UsageRecord] = []
        call = replace(
            call,
            klass=BATCH_CLASS,
            local_only=True,
            batch_record=usage_record_id(item.parent_id, item.index),
            held=held,
        )
        response, ex = await self._serve(call, record, reply_headers, lambda work: work)
        usage = ex.progress.usage if ex is not None else {}
        return WorkOutcome.of(response, usage, held[-1] if held else None)

    async def _serve(
        self,
        call: Call,
        record: ApiKeyRecord,
        reply_headers: dict[str, str],
        guard: Callable[[Awaitable[Response]], Awaitable[Response]],
    ) -> tuple[Response, Exchange | None]:
        """An admitted call through quota, dispatch and accounting (booked once); `guard`
        wraps the dispatch (a client's disconnect ends it)."""
        try:
            with call.trace.step("gateway.quota", {tracing.KEY_ID: record.key_id}):
                reservation, limit_headers = self.quota.admit(
                    record, call.info, call.info.worst_case_tokens(), call.adapter
                )
        except GatewayError as err:  # over a quota: the refusal is demand the control plane sees
            self.accounting.refused(call, err.status, err.code)
            return error_response(err, reply_headers), None
        call = replace(call, limit_headers=limit_headers)
        ex = Exchange(call, Settlement(self.quota, reservation))
        reply_headers.update(limit_headers)
        self.metrics.in_flight.labels(call.deployment).inc()
        try:
            call.info.refuse_client_resume(call.forwarded_from is not None)
            response = await guard(self.dispatch.serve(ex))
        except GatewayError as err:
            self.accounting.finish(ex, err.status)
            return error_response(err, reply_headers), ex
        except ClientGone:
            self.accounting.finish(ex, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED), ex
        except BaseException:
            self.accounting.finish(ex, 500)
            raise
        return self._stamp(response, ex), ex

    async def _call(
        self,
        request: Request,
        request_id: str,
        record: ApiKeyRecord,
        endpoint: Endpoint,
        started: float,
        forward: PeerForward | None,
        trace: RequestTrace | None = None,
    ) -> Call:
        """The request parsed once, its deployment known and allowed, its prompt counted."""
        raw = await read_body(request, self.config.gateway.max_body_bytes)
        return await self._call_of(
            raw, request_id, record, endpoint, started, forward, request.headers, trace
        )

    async def _call_of(
        self,
        raw: bytes,
        request_id: str,
        record: ApiKeyRecord,
        endpoint: Endpoint,
        started: float,
        forward: PeerForward | None,
        headers: Mapping[str, str],
        trace: RequestTrace | None = None,
    ) -> Call:
        info = await parse_off_loop(raw, endpoint)
        adapter, info = self.adapters.split(self.view.replicas, self.view.known(info.deployment), info)
        self.auth.authorize(record, info.deployment)
        if not self.view.known(info.deployment):
            raise GatewayError(
                404,
                f"The model '{info.deployment}' does not exist (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        policy = self.residency.allowed_for(record, self.view.route(info.deployment))
        if forward is not None:  # processed where it lands: only inside its residency
            self.residency.admit_forward(info.deployment, policy, forward.cluster)
        hop = self.pipelines.admit(
            headers,
            info.deployment,
            forwarded=forward is not None,
            allowed=policy,
            key_id=record.key_id,
        )
        if hop is not None and trace is not None:
            trace.pipeline_hop(hop)
        spec = self.desired.spec(info.deployment)  # None: served by peers only, who decide
        if spec is not None and (
            refused := refusal(info.deployment, spec.engine, spec.engine_args, endpoint, info.body)
        ):
            raise refused
        salted = spec is None or CAPABILITIES[spec.engine].cache_salt
        info, counter = await self.tokens.recount_async(info, off_loop=len(raw) > OFF_LOOP_BYTES)
        context = self.desired.context_tokens(info.deployment, self.config.gateway.default_context_tokens)
        info = replace(info, context_tokens=context)  # bounds what an open-ended request may generate
        self.metrics.prompt_tokens_counted.labels(info.deployment, counter).inc(info.prompt_tokens)
        return Call(
            request_id,
            record.key_id,
            info,
            started,
            forward.cluster if forward else None,
            adapter=adapter,
            klass=record.quotas.priority_class or self.config.gateway.default_class,
            max_concurrent=record.quotas.max_concurrent,
            draw=self._draw(info, headers.get(SESSION_HEADER)),
            block_keys=self.prefix.keys(info, record.key_id, salted),
            salted=salted,
            client=ClientHeaders(
                authorization=self.peers.carried_authorization(headers),
                session=headers.get(SESSION_HEADER) or None,
                hops=forward.hops if forward else 0,
                keep_ids=bool(headers.get(TOKEN_IDS_HEADER)),
            ),
            allowed=policy,
            pipeline=hop,
            trace=trace or RequestTrace(request_id, self.cluster),
        )

    def _draw(self, info: RequestInfo, session: str | None) -> float:
        """The canary split's draw: sticky per end user, else random; once per request."""
        draw = sticky_draw(info.user, session)
        return self.router.rng.random() if draw is None else draw

    def _stamp(self, response: Response, ex: Exchange) -> Response:
        """Where the answer came from: request id, cluster, version, queue time, a
        non-streamed answer's time to first token, limits."""
        p = ex.progress
        response.headers[REQUEST_ID_HEADER] = ex.call.request_id
        response.headers.setdefault("X-Fleet-Cluster", self.cluster)  # a peer's answer keeps its own
        if p.version is not None:
            response.headers.setdefault("X-Fleet-Version", str(p.version))  # which version answered
        if p.admitted:
            response.headers[QUEUE_HEADER] = f"{p.queue_s:.4f}"
        response.headers.update(ttft_header(p.reported_ttft_s))  # this hop's figure, not the upstream's
        hop = ex.call.pipeline
        if hop is not None:  # the id later hops carry (a peer that runs the request gave its own)
            response.headers[PIPELINE_HEADER] = hop.pipeline
            if hop.request_id:
                response.headers.setdefault(PIPELINE_REQUEST_HEADER, hop.request_id)
        if p.peer is None:  # a peer's answer carries the peer's limits
            for name, value in ex.call.limit_headers.items():
                response.headers[name] = value
        return response
