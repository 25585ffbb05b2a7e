"""Shadow traffic: copies of a share of a deployment's requests sent to replicas of a new
version (`RoutingTable.shadow`), measured, compared and discarded.

The gateway whose replica answers a request copies it, once that replica has taken the
original (a stream's first byte, a whole answer): the client's response never depends on
the copy, which runs as a background task this gateway holds (at most `max_copies` at
once), never awaited on the client's path. Where a copy may go and when it is dropped is
`agent.gateway.shadow_policy`'s: a free slot of a shadow replica here or nothing (a copy
never waits in the queue), the original's residency, tenancy (the same body, salted with
the key's prefix-cache salt) and LoRA adapter. A stream is read at full speed and thrown
away; a copy whose replica fails or dies mid-run is counted as an error and affects no
client.

Each copy leaves one usage record: `shadow=True`, `shadow_of` the original's record id,
the shadow version, its status, TTFT and ITL, and for a greedy request whether its output
equals the original's (`greedy_match`, `first_diff_token`; the original's output is held,
bounded, until the copy ends). The control plane counts it as shadow usage, never against
the key; this gateway takes no quota reservation for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from agent.gateway.accounting import Accounting
from agent.gateway.adapters import AdapterRouting
from agent.gateway.contract import accounting_usage
from agent.gateway.exchange import Call, Exchange
from agent.gateway.itl import TokenClock
from agent.gateway.load import LoadTracker
from agent.gateway.metrics import LATENCY_BUCKETS
from agent.gateway.migration import StreamLedger
from agent.gateway.plan import Attempt, ReplicaFacts
from agent.gateway.proxy import AttemptFailed, Deadlines, open_upstream
from agent.gateway.router import replica_facts
from agent.gateway.shadow_policy import (
    OUTCOMES,
    Choice,
    Comparison,
    Output,
    choose_replica,
    compare,
    copied,
    draw,
    greedy,
    shadow_version,
)
from agent.gateway.sse import EventSplitter, StreamObserver
from agent.gateway.state import ClusterView
from agent.gateway.tenancy import body_for
from agent.gateway.upstream import PATHS, REQUEST_ID_HEADER, work
from fleet_base.cluster_config import GatewayConfig
from fleet_base.openai_contract.continuation import TOKEN_IDS_HEADER
from fleet_base.protocol import MAX_USAGE_TOKENS, UsageRecord

log = logging.getLogger("agent.gateway")

MAX_COPIES = 64  # copies in flight at once per gateway; past it a copy is dropped (busy)
ORIGINAL_WAIT_S = 900.0  # how long a finished copy waits for its original to compare
TOKENIZE_OFF_LOOP_CHARS = 4096


@dataclass
class ShadowCopy:
    """One copy in flight: what it copies, and the original's side of the comparison."""

    call: Call
    version: int
    replica: ReplicaFacts
    record_id: str  # the original's
    greedy: bool
    original: Output = field(default_factory=Output)
    original_status: int | None = None
    original_done: asyncio.Event = field(default_factory=asyncio.Event)

    def original_finished(self, status: int) -> None:
        self.original_status = status
        self.original_done.set()


@dataclass
class CopyResult:
    status: int = 502
    failed: bool = True
    broke: bool = False  # unreachable, or the connection broke: not sent copies for a while
    usage: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None  # a streamed copy's, measured here
    reported_ttft_s: float | None = None  # an unstreamed copy's, from its replica (`Opened.first_token_s`)
    itl_s: float | None = None
    output: Output = field(default_factory=Output)


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "fleet_gateway_shadow_requests",
            "Shadow copies by outcome: sent, dropped_busy, dropped_residency, error, completed.",
            ["deployment", "outcome"], registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "fleet_gateway_shadow_tokens", "Prompt and completion tokens of shadow copies (never charged).",
            ["deployment"], registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "fleet_gateway_shadow_time_to_first_token_seconds",
            "A streamed copy's start to its first token (compare fleet_gateway_time_to_first_token_seconds).",
            ["deployment"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.greedy = Counter(
            "fleet_gateway_shadow_greedy",
            "Greedy copies compared with their original, by result: identical, differs.",
            ["deployment", "result"], registry=registry,
        )  # fmt: skip

    def know(self, deployment: str) -> None:
        for outcome in OUTCOMES:
            self.requests.labels(deployment, outcome)
        self.tokens.labels(deployment)
        self.ttft.labels(deployment)
        for result in ("identical", "differs"):
            self.greedy.labels(deployment, result)


class ShadowMirror:
    def __init__(
        self,
        *,
        view: ClusterView,
        tracker: LoadTracker,
        adapters: AdapterRouting,
        accounting: Accounting,
        settings: GatewayConfig,
        registry: CollectorRegistry,
        slots: Callable[[str], int],
        jurisdiction: Callable[[], str],
        replica_headers: Callable[[], dict[str, str]],
        tokenizer: Callable[[str], Any] = lambda deployment: None,
        salt: str | None = None,
        max_copies: int = MAX_COPIES,
    ) -> None:
        self.view = view
        self.tracker = tracker
        self.adapters = adapters
        self.accounting = accounting
        self.settings = settings
        self.metrics = ShadowMetrics(registry)
        self.slots = slots
        self.jurisdiction = jurisdiction
        self.replica_headers = replica_headers
        self.tokenizer = tokenizer
        self.salt = salt if salt is not None else secrets.token_hex(8)
        self.max_copies = max_copies
        self.client: httpx.AsyncClient | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ the decision

    def mirror(self, ex: Exchange, target: Attempt, body: bytes | None = None) -> ShadowCopy | None:
        """Copy the request `target` (a replica here) has just taken, when its draw says so
        and a shadow replica here is free; `body`: the original's whole answer (not a
        stream). Never blocks: the copy runs as a task."""
        call = ex.call
        info = call.info
        if (
            target.is_peer
            or ex.shadow is not None
            or info.resume_ids is not None
            or info.endpoint == "responses"
        ):
            return None
        route = self.view.route(call.deployment)
        version = shadow_version(route)
        if version is None or route is None or route.shadow is None or version == target.version:
            return None
        if not copied(route.shadow.share, draw(call.request_id, self.salt)):
            return None
        choice = self.choose(call, version)
        if choice.outcome == "sent" and len(self.tasks) >= self.max_copies:
            choice = Choice("dropped_busy")
        self.metrics.requests.labels(call.deployment, choice.outcome).inc()
        if choice.replica is None:
            return None
        copy = ShadowCopy(
            call, version, choice.replica, ex.progress.record_id, greedy(info.body, info.sequences)
        )
        ex.shadow = copy
        if body is not None and copy.greedy:
            copy.original.add_text(answer_text(body))
        self.tracker.start(choice.replica.replica_id, work(call, _attempt(choice.replica)))  # its slot, now
        task = asyncio.create_task(self._run(copy), name=f"shadow-{call.request_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return copy

    def choose(self, call: Call, version: int) -> Choice:
        replicas = [
            replica_facts(r, self.tracker, self.adapters)
            for r in self.view.ready(call.deployment)
            if r.version == version
        ]
        per_replica = self.slots(call.deployment)
        return choose_replica(
            replicas,
            version,
            per_replica,
            allowed=call.allowed,
            jurisdiction=self.jurisdiction(),
            adapter=call.adapter,
        )

    # ------------------------------------------------------------------ the copy

    async def _run(self, copy: ShadowCopy) -> None:
        call, replica = copy.call, copy.replica
        started = time.monotonic()
        result = CopyResult()
        try:
            result = await self._send(copy, started)
        except asyncio.CancelledError:
            raise
        except Exception:  # a copy must never take the gateway down with it
            log.exception("request %s: the shadow copy failed", call.request_id)
        finally:
            self.tracker.finish(replica.replica_id, work(call, _attempt(replica)))
        errored = result.failed or result.status >= 500
        if result.broke:  # a version's own 5xx is what its copies measure: it keeps getting them
            self.tracker.mark_failed(replica.replica_id)
        if errored and result.status < 500:
            result.status = 502
        comparison = Comparison()
        if copy.greedy and not errored and 200 <= result.status < 300:
            comparison = await self._compare(copy, result.output)
        deployment = call.deployment
        self.metrics.requests.labels(deployment, "error" if errored else "completed").inc()
        prompt = _tokens(result.usage.get("prompt_tokens"))
        completion = _tokens(result.usage.get("completion_tokens"))
        if prompt + completion:
            self.metrics.tokens.labels(deployment).inc(prompt + completion)
        if result.ttft_s is not None:
            self.metrics.ttft.labels(deployment).observe(result.ttft_s)
        if comparison.greedy_match is not None:
            self.metrics.greedy.labels(
                deployment, "identical" if comparison.greedy_match else "differs"
            ).inc()
        region, jurisdiction = self.accounting.where()
        self.accounting.usage.submit(
            UsageRecord(
                cluster=self.accounting.cluster,
                key_id=call.key_id,
                deployment=deployment,
                version=copy.version,
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=result.status,
                ttft_s=result.ttft_s if result.ttft_s is not None else result.reported_ttft_s,
                itl_s=result.itl_s,
                latency_s=time.monotonic() - started,
                adapter=call.adapter,
                region=region,
                jurisdiction=jurisdiction,
                shadow=True,
                shadow_of=copy.record_id,
                greedy_match=comparison.greedy_match,
                first_diff_token=comparison.first_diff_token,
            )
        )

    async def _send(self, copy: ShadowCopy, started: float) -> CopyResult:
        """Send the copy and read its whole answer (a stream at full speed, discarded)."""
        call, replica = copy.call, copy.replica
        result = CopyResult()
        if call.adapter is not None:
            status = next((r for r in self.view.replicas if r.replica_id == replica.replica_id), None)
            if status is None or await self.adapters.ensure(status, call.adapter) == "failed":
                return result
        assert self.client is not None
        headers = {
            "content-type": "application/json",
            REQUEST_ID_HEADER: f"{call.request_id}-shadow",
            **self.replica_headers(),
        }
        if call.info.migratable:  # token ids on every chunk, as the original gets them
            headers[TOKEN_IDS_HEADER] = "1"
        try:
            opened = await open_upstream(
                self.client,
                replica.url + PATHS[call.info.endpoint],
                headers,
                body_for(call.info, call.key_id, False, call.salted),  # the key's prefix-cache salt
                self._deadlines(call),
            )
        except AttemptFailed as err:
            result.status = err.status or 502
            result.broke = err.status is None
            return result
        result.status = opened.status
        try:
            if call.info.stream and 200 <= opened.status < 300:
                await self._consume(opened, copy, started, result)
            else:
                data = await opened.read_rest()
                result.failed = False
                if 200 <= opened.status < 300:
                    result.usage = _usage(call, data)
                    result.reported_ttft_s = opened.first_token_s(started)
                    if copy.greedy:
                        result.output.add_text(answer_text(data))
        except (AttemptFailed, httpx.HTTPError) as err:
            log.info("request %s: the shadow copy broke: %s", call.request_id, err)
            result.failed = result.broke = True
        finally:
            await opened.close()
        return result

    async def _consume(self, opened: Any, copy: ShadowCopy, started: float, result: CopyResult) -> None:
        call = copy.call
        ledger = StreamLedger()
        clock = TokenClock()
        observer = StreamObserver(strip_usage=False, on_text=result.output.add_text if copy.greedy else None)
        splitter = EventSplitter()
        chunk = opened.first
        while True:
            for event in splitter.feed(chunk):
                seen = observer.tokens_seen
                observer.observe(ledger.take(event, False))
                now = time.monotonic()
                if observer.first_token and result.ttft_s is None:
                    result.ttft_s = now - started
                if observer.tokens_seen > seen:
                    clock.tick(now)
            try:
                chunk = await opened.rest.__anext__()
            except StopAsyncIteration:
                break
        if ledger.token_ids:
            result.output.add_ids(ledger.token_ids)
        result.failed = observer.error is not None or not observer.done
        if observer.usage:
            result.usage = accounting_usage(call.info.endpoint, observer.usage)
        result.itl_s = clock.itl(_tokens(result.usage.get("completion_tokens")) or observer.tokens_seen)

    async def _compare(self, copy: ShadowCopy, output: Output) -> Comparison:
        """The comparison once the original has finished (held until then, bounded)."""
        try:
            await asyncio.wait_for(copy.original_done.wait(), ORIGINAL_WAIT_S)
        except TimeoutError:
            return Comparison()
        status = copy.original_status
        if status is None or not 200 <= status < 300:
            return Comparison()
        tok = None if copy.original.has_ids and output.has_ids else self.tokenizer(copy.call.deployment)
        split: Callable[[str], Sequence[Any]] | None = None
        if tok is not None:

            def split(text: str) -> Sequence[Any]:
                return tok.encode(text, False)

        if copy.original.chars + output.chars > TOKENIZE_OFF_LOOP_CHARS:
            return await asyncio.to_thread(compare, copy.original, output, split)
        return compare(copy.original, output, split)

    def _deadlines(self, call: Call) -> Deadlines:
        gwc = self.settings
        first = gwc.first_byte_timeout_s
        if not call.info.stream:
            first += gwc.token_timeout_s * call.info.generated_tokens()
        return Deadlines(first_byte_s=first, gap_s=gwc.inter_chunk_timeout_s)

    async def close(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _attempt(replica: ReplicaFacts) -> Attempt:
    return Attempt("local", "shadow", replica.replica_id, replica.url, replica.version)


def answer_text(data: bytes) -> str:
    """The first choice's text of a whole (not streamed) chat or completion answer."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return ""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    message = first.get("message")
    text = message.get("content") if isinstance(message, dict) else first.get("text")
    return text if isinstance(text, str) else ""


def _usage(call: Call, data: bytes) -> dict[str, Any]:
    try:
        usage = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return {}
    return accounting_usage(call.info.endpoint, usage) if isinstance(usage, dict) else {}


def _tokens(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return min(value, MAX_USAGE_TOKENS) if ok else 0
