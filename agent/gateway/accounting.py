"""What a request leaves behind when it ends, booked exactly once: its queue slot back,
its quota settled (`Settlement`), request metrics, and a usage record when it was served
here (a peer that served it records it there). A record says where the request was
processed: this cluster's region and jurisdiction (`where`), since only this cluster's
replicas serve what it records."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from agent.gateway.exchange import Call, Exchange
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.pipeline_route import PipelineHop
from agent.gateway.plan import Attempt
from agent.gateway.queue import ReplicaQueue
from agent.gateway.usage import UsagePublisher
from fleet_base.protocol import MAX_USAGE_TOKENS, UsageRecord

CLIENT_CLOSED = 499  # status recorded when the client went away (nginx's convention)


class Accounting:
    def __init__(
        self, cluster: str, metrics: GatewayMetrics, usage: UsagePublisher, queue: ReplicaQueue
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.usage = usage
        self.queue = queue
        self.where: Callable[[], tuple[str, str]] = lambda: ("", "")  # (region, jurisdiction)
        # a pipeline hop this cluster served ended: (hop, status, seconds at this gateway)
        self.hop_finished: Callable[[PipelineHop, int, float], None] = lambda hop, status, s: None

    def _record(self, call: Call, **fields: Any) -> UsageRecord:
        region, jurisdiction = self.where()
        return UsageRecord(
            cluster=self.cluster,
            key_id=call.key_id,
            deployment=call.deployment,
            latency_s=time.monotonic() - call.started,
            region=region,
            jurisdiction=jurisdiction,
            batch=call.batch_record is not None,
            **_pipeline_fields(call),
            **fields,
        )

    def count(self, deployment: str, status: int, started: float) -> None:
        self.metrics.requests.labels(deployment, str(status)).inc()
        self.metrics.duration.labels(deployment).observe(time.monotonic() - started)

    def refused(self, call: Call, status: int, reason: str | None = None) -> None:
        """Over a quota: the refusal is demand the control plane sees."""
        self.count(call.deployment, status, call.started)
        call.trace.finish(status, call=call, reason=reason)
        self._submit(
            call,
            self._record(
                call,
                status=status,
                refused_tokens=min(call.info.cost_tokens, MAX_USAGE_TOKENS),
                adapter=call.adapter,
                record_id=_record_id(call, secrets.token_hex(12)),
            ),
        )

    def attempt_failed(self, call: Call, target: Attempt, status: int) -> None:
        """Telemetry of a replica attempt that failed and was retried: rollouts judge the
        version that failed, not the one that answered in the end."""
        self.usage.submit(self._record(call, version=target.version, status=status, attempt_failed=True))

    def finish(self, ex: Exchange, status: int) -> None:
        """Account one request exactly once: metrics always; a usage record when it was
        served (or refused) here, not when a peer served it (the peer records it)."""
        p, call = ex.progress, ex.call
        if p.finished:
            return
        p.finished = True
        deployment = call.deployment
        if p.admitted:
            self.queue.release(deployment, call.key_id)
        ex.settlement.settle(p.usage, p.ran)
        self.metrics.in_flight.labels(deployment).dec()
        self.count(deployment, status, call.started)
        if p.ttft_s is not None:
            self.metrics.ttft.labels(deployment).observe(p.ttft_s)
        if ex.shadow is not None:  # its copy compares outputs once the original is done
            ex.shadow.original_finished(status)
        call.trace.finish(status, call=call, progress=p)
        if p.peer is not None:
            return
        if call.pipeline is not None and call.pipeline.decision.action == "local":  # served here
            self.hop_finished(call.pipeline, status, time.monotonic() - call.started)
        prompt = _int(p.usage.get("prompt_tokens"))
        completion = _int(p.usage.get("completion_tokens"))
        if prompt:
            self.metrics.tokens.labels(deployment, "prompt").inc(prompt)
        if completion:
            self.metrics.tokens.labels(deployment, "completion").inc(completion)
        prompt = min(prompt + ex.settlement.abandoned_tokens, MAX_USAGE_TOKENS)  # the key paid for those too
        self._submit(
            call,
            self._record(
                call,
                version=p.version,
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                ttft_s=p.ttft_s if p.ttft_s is not None else p.reported_ttft_s,
                itl_s=p.itl_s,
                adapter=call.adapter,
                record_id=_record_id(call, p.record_id),
            ),
        )

    def _submit(self, call: Call, record: UsageRecord) -> None:
        """Published, or held for the worker when the call runs a batch line or async
        request (booked by the run whose result was stored; a run the worker retries, or
        one whose result lost the create, is not booked at all)."""
        if call.held is not None:
            call.held.append(record)
        else:
            self.usage.submit(record)


def _pipeline_fields(call: Call) -> dict[str, str | None]:
    hop = call.pipeline
    if hop is None:
        return {}
    return {"pipeline": hop.pipeline, "pipeline_step": hop.step, "pipeline_request": hop.request_id or None}


def _int(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return min(value, MAX_USAGE_TOKENS) if ok else 0


def _record_id(call: Call, own: str) -> str:
    """A batch line's or async request's answer is booked under the line's id, whatever
    its status, so the line is booked once however many times it ran."""
    return call.batch_record if call.batch_record is not None else own
