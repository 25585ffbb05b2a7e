"""Streams that survive their replica: a stream that breaks mid-flight goes on elsewhere.

The gateway asks replicas to put the generated token ids on every streamed chunk
(`fleet_base.openai_contract.continuation`). `StreamLedger` keeps them per in-flight stream
and strips them (and any other leg's identity) before the client sees a chunk. When the
upstream fails after the first byte (connection reset, the replica died, an in-band
error, the inter-chunk timeout, a stream that ends before it finished), `relay` asks the
gateway for the next target of the routing plan and re-issues the request with the ids as
a continuation: the new replica prefills prompt + ids and streams exactly the text not
yet sent (it replays the detokenizer and the stop-string window itself, so a partial
UTF-8 character or a held-back stop-string prefix is neither lost nor sent twice). Its
usage chunk counts the whole request, once; the dead leg never sent one. At most
`migration_limit` hand-overs per stream; after that, or with no target left, the client
gets the in-band error event as before.

Migrated: streamed chat and completions of one sequence (n = 1, one prompt) without
tools (a tool-call parser's state is not carried), from and to replicas whose engine speaks
the continuation form (`fleet_base.engines` `fleet_continuation`: Fleet's own). A stream
of a foreign engine (vLLM, SGLang, llama.cpp) ends with the in-band error when its replica
fails; a stream whose chunks came without ids (a peer's foreign replica) is never
continued, since the text already sent could not be accounted for. Everything else keeps
the old behaviour.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from agent.gateway.errors import sse_error_event
from agent.gateway.exchange import Call
from agent.gateway.inputs import RequestInfo
from agent.gateway.plan import Attempt, Plan
from agent.gateway.proxy import AttemptFailed, Opened
from agent.gateway.sse import EventSplitter, SseEvent, StreamObserver, encode_event
from fleet_base.openai_contract.continuation import RESUME_FIELD, SLOW_READER_CODE, TOKEN_IDS_FIELD
from fleet_base.residency import permits

REASONS = ("reset", "timeout", "closed", "error_event", "drain")
DRAINING_CODE = "replica_draining"  # the in-band error of a replica handing a stream over
GAP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class MidstreamFailure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class MigrationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.migrations = Counter(
            "fleet_gateway_stream_migrations",
            "Streams continued on another target after a mid-stream failure, by reason "
            "(reset, timeout, closed, error_event, drain).",
            ["deployment", "reason"], registry=registry,
        )  # fmt: skip
        self.reprefill = Counter(
            "fleet_gateway_migration_reprefill_tokens",
            "Tokens the continuation target prefilled again (prompt + tokens already generated).",
            ["deployment"], registry=registry,
        )  # fmt: skip
        self.gap = Histogram(
            "fleet_gateway_migration_gap_seconds",
            "Client-visible gap of a migration: last chunk before the failure to the first after it.",
            ["deployment"], buckets=GAP_BUCKETS, registry=registry,
        )  # fmt: skip
        self.failed = Counter(
            "fleet_gateway_stream_migrations_failed",
            "Mid-stream failures not migrated (limit reached, nothing to continue on): the client got an error.",
            ["deployment"], registry=registry,
        )  # fmt: skip

    def know(self, deployment: str) -> None:
        for reason in REASONS:
            self.migrations.labels(deployment, reason)
        self.reprefill.labels(deployment)
        self.gap.labels(deployment)
        self.failed.labels(deployment)


@dataclass
class StreamLedger:
    """What one stream has delivered: token ids, its identity, whether it finished."""

    keep_ids: bool = False  # forward the ids (the client is a peer gateway that may migrate)
    token_ids: list[int] = field(default_factory=list)
    stream_id: str | None = None
    created: int | None = None
    finished: bool = False
    # a choice came without its ids (an engine that does not speak the form): not continuable
    untracked: bool = False
    last_sent_at: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, info: RequestInfo, keep_ids: bool) -> StreamLedger:
        """A stream's ledger; a continuation a peer forwarded starts with its resumed ids."""
        return cls(keep_ids=keep_ids, token_ids=list(info.resume_ids or ()))

    def take(self, event: bytes, migrating: bool) -> bytes:
        """The event to forward: ids recorded and stripped, the first leg's id and created
        kept. An in-band error raises `MidstreamFailure` when the stream can migrate (not
        the one a replica ends a stream with when its client stopped reading)."""
        parsed = SseEvent.parse(event)
        payload = parsed.payload
        if payload is None:
            return event
        error = parsed.error
        if error is not None:
            if migrating and not self.finished and error.get("code") != SLOW_READER_CODE:
                reason = "drain" if error.get("code") == DRAINING_CODE else "error_event"
                raise MidstreamFailure(reason, str(error.get("message", ""))[:200])
            return event
        changed = False
        for name in ("id", "created"):
            mine = self.stream_id if name == "id" else self.created
            if mine is None:
                setattr(self, "stream_id" if name == "id" else "created", payload.get(name))
            elif name in payload and payload[name] != mine:
                payload[name] = mine
                changed = True
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get(TOKEN_IDS_FIELD) if self.keep_ids else choice.pop(TOKEN_IDS_FIELD, None)
            changed = changed or (ids is not None and not self.keep_ids)
            if isinstance(ids, list):
                self.token_ids.extend(i for i in ids if isinstance(i, int))
            elif _has_output(choice):
                self.untracked = True
            if choice.get("finish_reason") is not None:
                self.finished = True
        return encode_event(payload) if changed else event

    def continuation(self, body: bytes) -> bytes:
        """`body` (what the first leg was sent) continuing after the ids delivered so far."""
        return json.dumps({**json.loads(body), RESUME_FIELD: self.token_ids}, ensure_ascii=False).encode()


def _has_output(choice: dict) -> bool:
    """A streamed choice carrying text (chat delta or completion) or tool calls."""
    delta = choice.get("delta")
    if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
        return True
    return bool(choice.get("text"))


@dataclass
class Leg:
    """One upstream a stream is read from; `name` is the replica or peer."""

    opened: Opened
    name: str
    is_peer: bool


# (body for a replica (False) or a peer (True), names that failed) -> the next leg, or
# None when no target answered
Reopen = Callable[[Callable[[bool], bytes], list[str]], Awaitable["Leg | None"]]
# a leg is done with (failed or not): release its load, mark it failed
Release = Callable[[Leg, bool], Awaitable[None]]


@dataclass
class RelayState:
    """What `relay` leaves for the gateway's accounting: the final leg and the status."""

    leg: Leg
    status: int
    migrations: int = 0


async def relay(
    state: RelayState,
    ledger: StreamLedger,
    observer: StreamObserver,
    *,
    deployment: str,
    limit: int,
    prompt_tokens: int,
    body_for: Callable[[bool], bytes],
    reopen: Reopen,
    release: Release,
    metrics: MigrationMetrics,
    on_event: Callable[[], None],
    log_failure: Callable[[str, Exception], None],
    not_continued: Callable[[str], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The client's SSE bytes: the legs' events in order, a migration at each failure.
    `body_for(is_peer)`: the first leg's body for a replica or a peer (continuation is
    added here). `on_event` runs after each observed event (TTFT). `not_continued(reason)`:
    the in-band error of a stream that could not be continued (default: upstream_failed)."""
    failed: list[str] = []
    gap_open = False
    while True:
        leg = state.leg
        splitter = EventSplitter()
        try:
            chunk = leg.opened.first
            while True:
                for event in splitter.feed(chunk):
                    out = observer.observe(ledger.take(event, limit > 0))
                    on_event()
                    if out:
                        if gap_open and ledger.token_ids:
                            metrics.gap.labels(deployment).observe(time.monotonic() - ledger.last_sent_at)
                            gap_open = False
                        ledger.last_sent_at = time.monotonic()
                        yield out
                try:
                    chunk = await leg.opened.rest.__anext__()
                except StopAsyncIteration:
                    break
            rest = splitter.rest()
            if rest:
                yield rest
            if observer.done or observer.error is not None:
                return
            raise MidstreamFailure("closed", "the upstream closed the stream before it finished")
        except (httpx.HTTPError, MidstreamFailure) as err:
            reason = err.reason if isinstance(err, MidstreamFailure) else failure_reason(err)
            log_failure(leg.name, err)
            await release(leg, True)
            failed.append(leg.name)
            if ledger.finished:  # everything was delivered but the end: end it here
                yield b"data: [DONE]\n\n"
                return
            nxt = None
            if state.migrations < limit and not ledger.untracked:
                nxt = await reopen(lambda is_peer: ledger.continuation(body_for(is_peer)), failed)
            if nxt is None:
                metrics.failed.labels(deployment).inc()
                state.status = 502
                yield (not_continued or upstream_failed)(reason)
                return
            state.migrations += 1
            metrics.migrations.labels(deployment, reason).inc()
            metrics.reprefill.labels(deployment).inc(prompt_tokens + len(ledger.token_ids))
            state.leg = nxt
            gap_open = True


def upstream_failed(reason: str) -> bytes:
    return sse_error_event(
        502, f"The upstream failed while streaming ({reason}); it could not be continued", "upstream_failed"
    )


def failure_reason(err: Exception) -> str:
    return "timeout" if isinstance(err, httpx.TimeoutException) else "reset"


class Targets(Protocol):
    """The routing plan as it is now, and whether a target can take the request's adapter
    (`agent.gateway.router.Router`)."""

    def plan(self, call: Call) -> Plan: ...

    async def adapter_ready(self, call: Call, target: Attempt) -> bool: ...

    def continues(self, target: Attempt) -> bool: ...


class Opener(Protocol):
    """The one upstream opener (`agent.gateway.upstream.Upstreams`): a failure is booked
    there; `release` gives back the load of an answer not taken."""

    async def open(self, call: Call, target: Attempt, body: bytes) -> Opened: ...

    def release(self, call: Call, target: Attempt) -> None: ...


async def open_continuation(
    targets: Targets,
    opener: Opener,
    call: Call,
    make_body: Callable[[bool], bytes],
    failed: list[str],
) -> tuple[Attempt, Opened] | None:
    """Open the continuation at the next target of the routing plan as it is now (local
    replicas best first, then peers), skipping those this stream already failed on. The
    plan holds only targets the request's residency permits; each is checked again here,
    since a continuation carries everything the stream generated so far."""
    seen = set(failed)
    for target in targets.plan(call).attempts:
        if not target.name or target.name in seen or not permits(call.allowed, target.jurisdiction):
            continue
        if not targets.continues(target):  # a foreign engine's replica: it cannot resume
            continue
        seen.add(target.name)
        if not await targets.adapter_ready(call, target):  # a LoRA request: its adapter must be there
            continue
        try:
            opened = await opener.open(call, target, make_body(target.is_peer))
        except AttemptFailed:
            continue
        if opened.status >= 300:  # refused the continuation (a 4xx): try the next one
            await opened.close()
            opener.release(call, target)
            continue
        return target, opened
    return None
