"""Walks a request's routing plan doing the I/O: each stage's attempts in order through
the one upstream opener, and what a failure means read from the stage's rule
(`agent.gateway.plan.STAGE_RULES`): fall through, fail over, or give up. Failures before
the client's first byte are retried elsewhere; afterwards a stream migrates
(`agent.gateway.stream`). Residency is the plan's: when it leaves nothing permitted (from
the start, after the queue, or at failover) the client gets 503 `residency_unavailable`
(`agent.gateway.residency`), never a target outside the set."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response

from agent.gateway.accounting import Accounting
from agent.gateway.contract import accounting_usage
from agent.gateway.demand import DemandSignal
from agent.gateway.errors import GatewayError
from agent.gateway.exchange import Exchange
from agent.gateway.migration import MigrationMetrics
from agent.gateway.plan import STAGE_RULES, Attempt, Plan
from agent.gateway.proxy import AttemptFailed, Opened
from agent.gateway.queue import ReplicaQueue
from agent.gateway.residency import ResidencyGate
from agent.gateway.router import Router
from agent.gateway.shadow import ShadowMirror
from agent.gateway.stream import StreamSession
from agent.gateway.tenancy import body_for
from agent.gateway.upstream import Upstreams
from fleet_base import tracing
from fleet_base.cluster_config import GatewayConfig


@dataclass
class Dispatcher:
    settings: GatewayConfig
    router: Router
    upstreams: Upstreams
    accounting: Accounting
    queue: ReplicaQueue
    demand: DemandSignal
    migration_metrics: MigrationMetrics
    residency: ResidencyGate
    shadow: ShadowMirror | None = None

    async def serve(self, ex: Exchange) -> Response:
        """Walk the plan's stages; a stage entered only after a failure (failover) is
        walked when the stage before asked for it and peers are still alive."""
        plan = self._permitted(ex, self._plan(ex))
        pending: GatewayError | None = None  # the failure a failover stage answers
        for stage in plan.stages:
            rule = STAGE_RULES[stage]
            if rule.after_failure and pending is None:
                continue
            if rule.queue:
                plan = self._permitted(ex, await self._queue(ex, plan))
            attempts = (
                [a for a in plan.stage(stage) if self.router.alive(a)]
                if rule.after_failure
                else plan.stage(stage)
            )
            if rule.after_failure and not attempts:
                break
            try:
                return await self.attempts(ex, attempts, pass_failure=rule.on_failure != "next-stage")
            except GatewayError as err:
                if rule.on_failure == "next-stage":  # nobody answered: served here after all
                    if rule.mark_down:  # no primary answered: skip them for a while
                        for target in attempts:
                            self.router.liveness.mark_down(target.name)
                    continue
                if rule.on_failure != "failover" or err.status not in (502, 503) or pending is not None:
                    raise
                pending = err  # every local attempt failed before a byte: the peers alive now
        if pending is not None:
            if plan.excluded and not plan.stage("failover"):  # it would have failed over outside
                raise self.residency.unavailable(ex.call.deployment, ex.call.allowed)
            raise pending
        raise self.queue.unavailable(ex.call.deployment, "no replica or peer can serve it")

    def _plan(self, ex: Exchange, replan: bool = False) -> Plan:
        """The routing plan on the facts as they are now (a routing span of the request's trace)."""
        plan = self.router.plan(ex.call)
        ex.call.trace.routed(plan, replan)
        return plan

    def _permitted(self, ex: Exchange, plan: Plan) -> Plan:
        """The plan, unless residency left it nothing to try (503, nothing sent)."""
        if plan.residency_unavailable:
            raise self.residency.unavailable(ex.call.deployment, ex.call.allowed)
        return plan

    async def _queue(self, ex: Exchange, plan: Plan) -> Plan:
        """A slot of this cluster's queue; after a wait, the plan on fresh load. A wait for a
        replica here that ends without one, while residency ruled out the peers that have
        them, is residency's answer (it names residency)."""
        deployment = ex.call.deployment
        call = ex.call
        with self._waiting(deployment), call.trace.step("gateway.queue", {"fleet.class": call.klass}) as span:
            try:
                ex.progress.queue_s = await self.queue.admit(
                    deployment, call.klass, call.key_id, call.max_concurrent
                )
            except GatewayError as err:
                if plan.excluded and err.code == "no_replica_available":
                    raise self.residency.unavailable(deployment, call.allowed) from None
                raise
            tracing.set_attributes(span, {"fleet.queue_s": ex.progress.queue_s})
        ex.progress.admitted = True
        local = plan.stage("local")
        if ex.progress.queue_s > 0 or not local or not local[0].name:
            return self._plan(ex, replan=True)
        return plan

    def _waiting(self, deployment: str) -> contextlib.AbstractContextManager[None]:
        """Counts the request as demand while it waits for a replica slot."""
        if not self.queue.would_wait(deployment):
            return contextlib.nullcontext()
        return self.demand.waiting(deployment, len(self.router.view.ready(deployment)))

    async def _usable(self, ex: Exchange, targets: list[Attempt]) -> AsyncIterator[tuple[int, Attempt]]:
        """The attempts in order, numbered, less replicas where the request's LoRA adapter
        could not be loaded (nothing was sent there; the next one is tried)."""
        n = 0
        for target in targets:
            if not target.name or not await self.router.adapter_ready(ex.call, target):
                continue
            yield n, target
            n += 1

    async def attempts(self, ex: Exchange, targets: list[Attempt], pass_failure: bool = True) -> Response:
        """Try a target; on a failure before the first byte, once more on another one (twice
        more when every failure so far was work never started: a refused connection or a
        503 from a replica shutting down, as when a rollout or failover moves replicas; not
        a timeout, whose work may have run and is charged)."""
        call = ex.call
        failure: AttemptFailed | None = None
        unstarted = True  # every failure so far: nothing ran there
        async for attempt, target in self._usable(ex, targets):
            if attempt == 2 and not unstarted:
                break
            if attempt:
                self.accounting.metrics.retries.labels(call.deployment).inc()
            self.router.prefix.count(call.info, target)
            try:
                opened, data = await self._open(ex, target)
            except AttemptFailed as err:  # a timeout may have run its work: it counts as started
                unstarted = unstarted and err.status in (None, 503) and err.reason not in ("read", "timeout")
                if target.is_peer and err.status is None:
                    self.router.liveness.mark_down(target.name)
                if not target.is_peer and err.status is not None and err.status != 503:
                    self.accounting.attempt_failed(call, target, err.status)  # a 503: shutting down
                failure = err
                continue
            ex.took(target, opened.status)
            if self.shadow is not None:  # routed and answering: a copy may go to the shadow version
                self.shadow.mirror(ex, target, data)
            if data is not None:
                self.upstreams.release(call, target)
                return self._whole(ex, opened, data)
            return StreamSession(
                ex,
                opened,
                target,
                router=self.router,
                upstreams=self.upstreams,
                accounting=self.accounting,
                metrics=self.migration_metrics,
                migration_limit=self.settings.migration_limit,
                write_timeout_s=self.settings.client_write_timeout_s,
                residency=self.residency,
            ).response()
        return self._failed(ex, failure, pass_failure, unstarted)

    async def _open(self, ex: Exchange, target: Attempt) -> tuple[Opened, bytes | None]:
        """The attempt opened; with its whole body unless it is a stream for the client.
        Given up after it was sent (its deadline, or the client left), it is charged: the
        replica may have worked on it, and closing the connection stopped it there."""
        call = ex.call
        try:
            opened = await self.upstreams.open(
                call, target, body_for(call.info, call.key_id, target.is_peer, call.salted)
            )
            if opened.status >= 300 or not call.info.stream:
                return opened, await self.upstreams.read(call, target, opened)
            return opened, None
        except AttemptFailed as err:
            if err.reason == "timeout":
                self._abandoned(ex, target, "timeout")
            raise
        except asyncio.CancelledError:
            self._abandoned(ex, target, "client_gone")
            raise

    def _abandoned(self, ex: Exchange, target: Attempt, reason: str) -> None:
        tokens = ex.abandoned(target)
        if tokens:
            self.accounting.metrics.abandoned_tokens.labels(ex.call.deployment, reason).inc(tokens)

    def _failed(
        self, ex: Exchange, failure: AttemptFailed | None, pass_failure: bool, unstarted: bool = False
    ) -> Response:
        deployment = ex.call.deployment
        if failure is not None and failure.status is not None and pass_failure:
            self.accounting.finish(ex, failure.status)
            return Response(failure.body, status_code=failure.status, headers=failure.headers)
        hop = ex.call.pipeline
        if failure is not None and unstarted and hop is not None and hop.local_only:
            # the step's replica here went away before the view said so: nothing ran, and a
            # later hop may not leave the cluster, so the pipeline request is refused whole
            raise GatewayError(
                503,
                f"Pipeline '{hop.pipeline}': the step's replica of '{deployment}' here went away "
                f"({failure.detail}); restart the pipeline request",
                code="pipeline_step_unavailable",
                headers={"Retry-After": str(self.queue.retry_after_s)},
            )
        if failure is not None:
            raise GatewayError(
                502,
                f"The upstream serving '{deployment}' failed before responding ({failure.detail}); retry the request",
                code="upstream_failed",
                headers={"Retry-After": str(self.queue.retry_after_s)},
            )
        raise self.queue.unavailable(deployment, "its replicas went away")

    def _whole(self, ex: Exchange, opened: Opened, data: bytes) -> Response:
        if 200 <= opened.status < 300:
            try:
                usage = json.loads(data).get("usage")
            except (ValueError, AttributeError):
                usage = None
            if isinstance(usage, dict):
                ex.progress.usage = accounting_usage(ex.call.info.endpoint, usage)
            ex.progress.reported_ttft_s = opened.first_token_s(ex.call.started)
        self.accounting.finish(ex, opened.status)
        return Response(data, status_code=opened.status, headers=opened.headers())
