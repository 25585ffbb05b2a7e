"""A request's trace at this gateway, and its access log line.

One server span per request continues the W3C context the client (or the peer gateway
that forwarded it) sent, else starts a trace; the steps of the request's walk are its
children: authentication, the quota check, the wait for a replica slot, each routing
decision, every upstream attempt (first, retries, failover, a stream's continuations;
its context travels in the attempt's headers, so a replica or a peer gateway continues
the trace) and each stream migration. Spans hold identifiers and counts only (`fleet_base.tracing`).

The access log (`agent.gateway.access`, on with `gateway.access_log`) has one line per
request when it ends, with its trace id, so a log line leads to its trace.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.gateway.errors import GatewayError
from fleet_base import tracing
from fleet_base.tracing import INVALID_SPAN, Span

if TYPE_CHECKING:
    from agent.gateway.exchange import Call, Progress
    from agent.gateway.pipeline_route import PipelineHop
    from agent.gateway.plan import Attempt, Plan

access_log = logging.getLogger("agent.gateway.access")

_OFF = contextlib.nullcontext(INVALID_SPAN)


@dataclass
class RequestTrace:
    """The server span of one request (the invalid span while tracing is off)."""

    request_id: str = ""
    cluster: str = ""
    server: Span = INVALID_SPAN
    started: float = 0.0
    attempts: int = 0
    ended: bool = False
    hop: Span = INVALID_SPAN  # a pipeline hop's span, from its routing decision to the answer

    @classmethod
    def begin(cls, request_id: str, cluster: str, headers: Mapping[str, str], endpoint: str) -> RequestTrace:
        server = tracing.start_span(
            "gateway.request",
            headers=headers,
            kind=tracing.SERVER,
            attributes={tracing.CLUSTER: cluster, "fleet.request_id": request_id, "fleet.endpoint": endpoint},
        )
        return cls(request_id, cluster, server, time.monotonic())

    def set(self, attributes: Mapping[str, Any]) -> None:
        tracing.set_attributes(self.server, attributes)

    @property
    def recording(self) -> bool:
        """Tracing is on and this request was sampled: its steps are worth spans."""
        return self.server.is_recording()

    def step(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A child span around a step; a `GatewayError` leaving it marks it failed with its code."""
        if not self.recording:
            return _OFF
        return self._step(name, attributes)

    @contextlib.contextmanager
    def _step(self, name: str, attributes: Mapping[str, Any] | None) -> Iterator[Span]:
        span = tracing.start_span(name, parent=self.server, attributes=attributes)
        try:
            yield span
        except GatewayError as err:
            tracing.set_attributes(span, {tracing.STATUS: err.status})
            tracing.fail(span, err.code or str(err.status))
            raise
        except BaseException as err:
            tracing.fail(span, type(err).__name__)
            raise
        finally:
            span.end()

    def routed(self, plan: Plan, replan: bool = False) -> None:
        """The routing decision: the plan's stages and why its first target won."""
        if not self.recording:
            return
        first = next((a for a in plan.attempts if a.name), plan.attempts[0] if plan.attempts else None)
        attributes: dict[str, Any] = {
            tracing.STAGE: plan.stages[0] if plan.stages else None,
            tracing.REASON: first.reason
            if first
            else ("residency" if plan.residency_unavailable else "none"),
            "fleet.target": first.name if first and first.name else None,
            "fleet.stages": list(plan.stages),
            "fleet.candidates": sum(1 for a in plan.attempts if a.name),
            "fleet.excluded": len(plan.excluded),
            "fleet.replan": replan,
        }
        tracing.start_span("gateway.route", parent=self.server, attributes=attributes).end()

    def pipeline_hop(self, hop: PipelineHop) -> None:
        """A pipeline request's hop here: its pipeline, step, request id and where it goes,
        on the server span and on a child span that ends with the hop."""
        if not self.recording:
            return
        attributes = {
            "fleet.pipeline": hop.pipeline,
            "fleet.pipeline.step": hop.step,
            "fleet.pipeline.request": hop.request_id or None,
            "fleet.pipeline.action": hop.decision.action,
            tracing.REASON: hop.decision.reason,
            "fleet.peer": hop.decision.peer or None,
            tracing.CLUSTER: hop.decision.peer or self.cluster,
        }
        self.set({k: v for k, v in attributes.items() if k.startswith("fleet.pipeline")})
        self.hop = tracing.start_span("gateway.pipeline_hop", parent=self.server, attributes=attributes)

    def attempt(self, target: Attempt) -> Span:
        """A client span for one upstream attempt (its caller ends it); numbered from 1. A request
        not sampled gets its server span back (not recording; its sampled-out context still
        travels on, so the replica and the peer gateway record nothing either)."""
        self.attempts += 1
        if not self.recording:
            return self.server
        return tracing.start_span(
            "gateway.attempt",
            parent=self.server,
            kind=tracing.CLIENT,
            attributes={
                tracing.STAGE: target.stage,
                tracing.REASON: target.reason,
                tracing.ATTEMPT: self.attempts,
                "fleet.peer" if target.is_peer else tracing.REPLICA: target.name,
                tracing.CLUSTER: target.name if target.is_peer else self.cluster,
                "fleet.version": target.version,
                "fleet.tokens.cached": target.cached_tokens or None,  # the prefix index's estimate
            },
        )

    def finish(
        self,
        status: int,
        *,
        call: Call | None = None,
        progress: Progress | None = None,
        key_id: str | None = None,
        reason: str | None = None,
    ) -> None:
        """The request ended (once): its outcome on the server span, then the access log line."""
        if self.ended:
            return
        self.ended = True
        usage = progress.usage if progress is not None else {}
        deployment = call.deployment if call is not None else None
        key_id = call.key_id if call is not None else key_id
        peer = progress.peer if progress is not None else None
        if self.recording:
            self.set(
                {
                    tracing.STATUS: status,
                    "http.response.status_code": status,
                    tracing.DEPLOYMENT: deployment,
                    tracing.MODEL: (call.adapter or call.deployment) if call is not None else None,
                    tracing.KEY_ID: key_id,
                    tracing.PROMPT_TOKENS: _count(usage.get("prompt_tokens")),
                    tracing.COMPLETION_TOKENS: _count(usage.get("completion_tokens")),
                    "fleet.peer": peer,
                    "fleet.version": progress.version if progress is not None else None,
                    "fleet.queue_s": progress.queue_s if progress is not None and progress.admitted else None,
                    "fleet.ttft_s": progress.ttft_s if progress is not None else None,
                    "fleet.attempts": self.attempts,
                }
            )
            if self.hop.is_recording():
                tracing.set_attributes(self.hop, {tracing.STATUS: status})
                if status >= 500:
                    tracing.fail(self.hop, reason or str(status))
                self.hop.end()
            if status >= 500:
                tracing.fail(self.server, reason or str(status))
            elif reason:
                self.set({tracing.REASON: reason})
            self.server.end()
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "request_id=%s cluster=%s deployment=%s key=%s status=%d latency_ms=%.1f "
                "prompt_tokens=%s completion_tokens=%s attempts=%d peer=%s trace_id=%s",
                self.request_id,
                self.cluster,
                deployment or "-",
                key_id or "-",
                status,
                (time.monotonic() - self.started) * 1000,
                _count(usage.get("prompt_tokens")) or 0,
                _count(usage.get("completion_tokens")) or 0,
                self.attempts,
                peer or "-",
                tracing.trace_id(self.server) or "-",
            )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
