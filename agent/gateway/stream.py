"""A streamed answer on its way to the client: relayed event by event, continued on
another target when its upstream breaks (`agent.gateway.migration`), ended when the client
stops reading (a write deadline), and accounted once however it ends (finished, cut by the
client, never started)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse

from agent.gateway.accounting import CLIENT_CLOSED, Accounting
from agent.gateway.contract import accounting_usage
from agent.gateway.errors import sse_error_event
from agent.gateway.exchange import Exchange
from agent.gateway.itl import TokenClock
from agent.gateway.migration import (
    Leg,
    MidstreamFailure,
    MigrationMetrics,
    RelayState,
    StreamLedger,
    failure_reason,
    open_continuation,
    relay,
    upstream_failed,
)
from agent.gateway.plan import Attempt
from agent.gateway.proxy import Opened
from agent.gateway.residency import ResidencyGate
from agent.gateway.router import Router
from agent.gateway.sse import StreamObserver
from agent.gateway.tenancy import body_for
from agent.gateway.upstream import Upstreams
from fleet_base import tracing

log = logging.getLogger("agent.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamSession:
    """One stream: its legs, what it delivered, and its single cleanup."""

    def __init__(
        self,
        ex: Exchange,
        opened: Opened,
        target: Attempt,
        *,
        router: Router,
        upstreams: Upstreams,
        accounting: Accounting,
        metrics: MigrationMetrics,
        migration_limit: int,
        write_timeout_s: float,
        residency: ResidencyGate | None = None,
    ) -> None:
        call = ex.call
        self.ex = ex
        self.router = router
        self.upstreams = upstreams
        self.accounting = accounting
        self.metrics = metrics
        self.residency = residency
        migrates = call.info.migratable and target.rule.midstream == "migrate" and router.continues(target)
        self.limit = migration_limit if migrates else 0
        self.first_ok = 200 <= opened.status < 300
        self.observer = StreamObserver(strip_usage=not target.is_peer and not call.info.client_wants_usage)
        if ex.shadow is not None and ex.shadow.greedy:  # held (bounded) for the copy's comparison
            self.observer.on_text = ex.shadow.original.add_text
        self.clock = TokenClock()
        self._tokens_seen = 0
        self.ledger = StreamLedger.of(call.info, call.forwarded_from is not None and call.client.keep_ids)
        self.state = RelayState(Leg(opened, target.name, target.is_peer), opened.status)
        self.targets = {target.name: target}
        self.write_timeout_s = write_timeout_s
        self.closed = False
        self._failure = ""  # why the last leg broke (a migration's reason)

    def response(self) -> StreamingResponse:
        opened = self.state.leg.opened
        return ProxiedStream(
            self.body(),
            self.cleanup,
            write_timeout_s=self.write_timeout_s,
            on_stalled=self.stalled,
            status_code=opened.status,
            headers={**opened.headers(), **SSE_HEADERS},
        )

    def stalled(self) -> None:
        call = self.ex.call
        self.accounting.metrics.streams_aborted.labels(call.deployment, "slow_reader").inc()
        log.info(
            "request %s: the client read nothing for %.0f s; stream ended, upstream closed",
            call.request_id,
            self.write_timeout_s,
        )

    async def body(self) -> AsyncIterator[bytes]:
        call = self.ex.call
        try:
            async for out in relay(
                self.state,
                self.ledger,
                self.observer,
                deployment=call.deployment,
                limit=self.limit,
                prompt_tokens=call.info.prompt_tokens,
                body_for=lambda is_peer: body_for(call.info, call.key_id, is_peer, call.salted),
                reopen=self.reopen,
                release=self.release,
                metrics=self.metrics,
                on_event=self.on_event,
                log_failure=self.log_failure,
                not_continued=self.not_continued,
            ):
                yield out
        except BaseException:
            self.state.status = CLIENT_CLOSED
            raise
        finally:
            await self.cleanup(self.state.status)

    async def reopen(self, make_body: Callable[[bool], bytes], failed: list[str]) -> Leg | None:
        call = self.ex.call
        attributes = {
            tracing.REASON: self._failure,
            tracing.ATTEMPT: self.state.migrations + 1,
            "fleet.from": failed[-1] if failed else None,
            "fleet.resumed_tokens": len(self.ledger.token_ids),
        }
        with call.trace.step("gateway.migration", attributes) as span:
            opened = await open_continuation(self.router, self.upstreams, call, make_body, failed)
            if opened is None:
                tracing.fail(span, "no_target")
                return None
            tracing.set_attributes(span, {"fleet.to": opened[0].name})
        target, upstream = opened
        self.targets[target.name] = target
        self.ex.took(target, upstream.status, continuation=True)
        return Leg(upstream, target.name, target.is_peer)

    def not_continued(self, reason: str) -> bytes:
        """The in-band error of a stream left with no target: one naming residency when
        the request's residency ruled out the targets that were left."""
        call = self.ex.call
        if self.residency is None or not self.router.plan(call).excluded:
            return upstream_failed(reason)
        err = self.residency.unavailable(call.deployment, call.allowed)
        return sse_error_event(
            err.status, f"The upstream failed while streaming ({reason}). {err.message}", err.code
        )

    async def release(self, leg: Leg, failed: bool) -> None:
        if failed:
            leg.opened.end_span(f"midstream_{self._failure}")
        await leg.opened.close()
        call = self.ex.call
        if failed:
            self.accounting.metrics.upstream_errors.labels(call.deployment, "midstream").inc()
        if not leg.is_peer:
            self.upstreams.release(call, self.targets[leg.name])
            if failed:
                self.upstreams.tracker.mark_failed(leg.name)

    async def cleanup(self, status: int) -> None:
        if self.closed:
            return
        self.closed = True
        await self.release(self.state.leg, False)
        p, info = self.ex.progress, self.ex.call.info
        if self.observer.usage:
            p.usage = accounting_usage(info.endpoint, self.observer.usage)
        elif not self.state.leg.is_peer and self.first_ok:
            # cut short (the client left, the upstream broke): charge what was streamed
            p.usage = {"prompt_tokens": info.prompt_tokens, "completion_tokens": self.observer.tokens_seen}
        completion = p.usage.get("completion_tokens")
        p.itl_s = self.clock.itl(completion if isinstance(completion, int) else self.observer.tokens_seen)
        if self.ex.shadow is not None and self.ex.shadow.greedy and self.ledger.token_ids:
            self.ex.shadow.original.add_ids(self.ledger.token_ids)
        self.accounting.finish(self.ex, status)

    def on_event(self) -> None:
        p = self.ex.progress
        now = time.monotonic()
        if self.observer.first_token and p.ttft_s is None:
            p.ttft_s = now - self.ex.call.started
        leg = self.state.leg
        if self.observer.first_token and not leg.is_peer and leg.name in self.targets:
            self.upstreams.first_token(self.ex.call, self.targets[leg.name])
        if self.observer.tokens_seen > self._tokens_seen:
            self._tokens_seen = self.observer.tokens_seen
            self.clock.tick(now)

    def log_failure(self, name: str, err: Exception) -> None:
        self._failure = err.reason if isinstance(err, MidstreamFailure) else failure_reason(err)
        log.warning("request %s: stream from %s broke: %s", self.ex.call.request_id, name, err)


class ClientStalled(Exception):
    """The client accepted none of a chunk's bytes within the write deadline."""


class ProxiedStream(StreamingResponse):
    """A streamed upstream response that is cleaned up however it ends: fully sent, cut
    by the client, never started (a disconnect before the first send), or stalled.

    A client that stops reading blocks `send` (the server's transport stays paused), so
    the upstream is no longer read and the replica's own queue fills: without a deadline
    the stream would hold its slot for as long as the client keeps the socket open."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cleanup: Callable[[int], Awaitable[None]],
        *,
        write_timeout_s: float,
        on_stalled: Callable[[], None],
        **kw: Any,
    ) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup
        self.write_timeout_s = write_timeout_s
        self._on_stalled = on_stalled

    async def abandon(self) -> None:
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            await close()
        await self._cleanup(CLIENT_CLOSED)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_by_deadline(message: Any) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled() from None

        try:
            await super().__call__(scope, receive, send_by_deadline)
        except ClientStalled:  # returning unfinished makes the server close the connection
            self._on_stalled()
        finally:
            await self.abandon()
