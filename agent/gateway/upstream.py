"""The one way a request reaches an upstream (a replica here or a peer gateway): first
attempts, retries, failover and a stream's continuations all open through `Upstreams`.
It builds the attempt's headers, counts the load it adds at a replica, opens up to the
first byte, and on a failure books it (error metric, the replica's load released and
marked failed) before the caller decides what the failure means (the plan's rule).
It is also residency's last check: a target outside the request's allowed set is refused
here, unsent, whatever chose it (the plan never should)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import httpx

from agent.gateway.exchange import Call
from agent.gateway.liveness import SESSION_HEADER
from agent.gateway.load import LoadTracker
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.peers import PeerAuth
from agent.gateway.plan import Attempt
from agent.gateway.proxy import AttemptFailed, Deadlines, Opened, open_upstream
from agent.gateway.residency import ResidencyGate
from fleet_base import tracing
from fleet_base.cluster_config import GatewayConfig
from fleet_base.openai_contract.continuation import TOKEN_IDS_HEADER
from fleet_base.openai_contract.errors import error_body
from fleet_base.openai_contract.priority import PRIORITY_CLASS_HEADER

log = logging.getLogger("agent.gateway")

REQUEST_ID_HEADER = "X-Request-Id"
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}


@dataclass
class Upstreams:
    cluster: str
    settings: GatewayConfig
    peers: PeerAuth
    tracker: LoadTracker
    metrics: GatewayMetrics
    client: httpx.AsyncClient | None = None  # set when the gateway starts
    residency: ResidencyGate | None = None
    # (request id, replica) -> the attempt's prefill not yet released by its first token
    prefilling: dict[tuple[str, str], int] = field(default_factory=dict)

    async def open(self, call: Call, target: Attempt, body: bytes) -> Opened:
        """`target`'s response up to its first byte; `AttemptFailed` (booked) otherwise."""
        assert self.client is not None
        if self.residency is not None and not self.residency.guard(call.allowed, target.jurisdiction):
            err = self.residency.unavailable_error(call.deployment, call.allowed)
            body_out = json.dumps(error_body(err.status, err.message, None, err.code)).encode()
            raise AttemptFailed(
                "residency", f"{target.name} is outside the request's residency", 503, body_out, err.headers
            )
        span = call.trace.attempt(target)
        headers = tracing.inject(self.headers(call, target), span)
        url = target.url + PATHS[call.info.endpoint]
        try:
            opened = await open_upstream(self.client, url, headers, body, self.deadlines(call, target))
        except AttemptFailed as err:
            tracing.set_attributes(span, {tracing.STATUS: err.status})
            tracing.fail(span, err.reason)
            span.end()
            self.failed(call, target, err)
            raise
        except BaseException as err:  # cancelled (the client left) or a bug: release the load
            tracing.fail(span, type(err).__name__)
            span.end()
            self.release(call, target)
            raise
        tracing.set_attributes(span, {tracing.STATUS: opened.status})
        opened.span = span
        return opened

    async def read(self, call: Call, target: Attempt, opened: Opened) -> bytes:
        """The rest of an answer that is not streamed to the client (still retriable)."""
        try:
            data = await opened.read_rest()
        except AttemptFailed as err:
            opened.end_span(err.reason)
            self.failed(call, target, err)
            raise
        except BaseException:
            await opened.close()
            self.release(call, target)
            raise
        opened.end_span()
        return data

    def failed(self, call: Call, target: Attempt, err: AttemptFailed) -> None:
        log.warning(
            "request %s: %s %s failed: %s",
            call.request_id,
            "peer" if target.is_peer else "replica",
            target.name,
            err,
        )
        self.metrics.upstream_errors.labels(call.deployment, err.reason).inc()
        if not target.is_peer:
            self.release(call, target)
            self.tracker.mark_failed(target.name)

    def release(self, call: Call, target: Attempt) -> None:
        """The attempt's work left the replica (answered, failed or abandoned)."""
        if not target.is_peer:
            prefill = self.prefilling.pop((call.request_id, target.name), 0)
            self.tracker.finish(target.name, work(call, target), prefill)

    def first_token(self, call: Call, target: Attempt) -> None:
        """The attempt's first token came: its prefill no longer queues at the replica (a
        stream's; an answer that is not streamed keeps it until it is released)."""
        if not target.is_peer:
            prefill = self.prefilling.pop((call.request_id, target.name), 0)
            if prefill:
                self.tracker.prefilled(target.name, prefill)

    def headers(self, call: Call, target: Attempt) -> dict[str, str]:
        """Headers of one attempt (counted as started: load, forwarding metrics)."""
        deployment = call.deployment
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: call.request_id}
        if call.info.migratable:  # the replica's chunks carry token ids for a migration
            headers[TOKEN_IDS_HEADER] = "1"
        if target.is_peer:
            if call.client.session:  # the peer keeps the user's canary side
                headers[SESSION_HEADER] = call.client.session
            headers.update(self.peers.to_peer(target.name, call))
            if call.pipeline is not None:  # the peer routes the hop the same way (kept there)
                headers.update(call.pipeline.headers())
            self.metrics.forwarded.labels(deployment, target.name).inc()
        else:
            headers.update(self.peers.replica_headers)
            if call.klass:  # the engine schedules the batch class after the others
                headers[PRIORITY_CLASS_HEADER] = call.klass
            prefill = new_prefill(call, target)
            self.prefilling[(call.request_id, target.name)] = prefill
            self.tracker.start(target.name, work(call, target), prefill)
            self.metrics.replica_choice.labels(deployment, target.name, str(target.version)).inc()
        return headers

    def deadlines(self, call: Call, target: Attempt) -> Deadlines:
        gwc = self.settings
        first = gwc.first_byte_timeout_s + (gwc.queue_timeout_s if target.is_peer else 0.0)
        if not call.info.stream:  # the first byte comes with the whole answer: all it may generate
            first += gwc.token_timeout_s * call.info.generated_tokens()
        return Deadlines(first_byte_s=first, gap_s=gwc.inter_chunk_timeout_s)


def work(call: Call, target: Attempt) -> int:
    """Queued work a request adds at a replica: its new prefill and reserved completion."""
    return max(0, call.info.cost_tokens - target.cached_tokens)


def new_prefill(call: Call, target: Attempt) -> int:
    """Of that, the prompt the replica must prefill (until the first token)."""
    return max(0, call.info.prompt_tokens - target.cached_tokens)
