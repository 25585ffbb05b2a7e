"""Async single requests: `POST /v1/async/<endpoint>` answers 202 at once and queues the
request as a work item of its own; `GET /v1/async/requests/{id}` shows its status and, once
it ran, its result; a `webhook_url` gets the result POSTed, signed (`webhooks`).

The body is the endpoint's normal request body plus `webhook_url` (optional), `priority`
(0 first, 0-2, default 1) and `max_time_in_queue_s` (default and bound in `BatchConfig`:
`async_queue_default_s`, `async_queue_max_s`); it is refused as the interactive request
would be (the same 400s, 404 for an unknown model, the key's scope and model permission),
and a webhook URL the SSRF guard refuses is a 400 that says why. A key sees only its own
requests (another key's id is a 404).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agent.gateway.batch.http import guarded, json_of, store_unavailable
from agent.gateway.errors import GatewayError
from agent.gateway.inputs import Endpoint, parse_off_loop, read_body
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    ASYNC_TERMINAL,
    AsyncRecord,
    AsyncStatus,
    BatchEndpoint,
    LineError,
    LineResult,
    StoredResult,
    WorkItem,
)
from fleet_base.batch.names import DEFAULT_ASYNC_PRIORITY, PRIORITIES, new_async_id, result_key
from fleet_base.batch.store import BatchStore, Conflict, NotFound
from fleet_base.batch.webhook_target import AllowList, Refused, Resolver, check
from fleet_base.bounds import InputError, load_json

if TYPE_CHECKING:
    from agent.gateway.batch.service import BatchService

log = logging.getLogger(__name__)
PATHS: dict[Endpoint, BatchEndpoint] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}


def _bad(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def async_fields(body: dict[str, Any], config: BatchConfig) -> tuple[str | None, int, float]:
    """(webhook_url, priority, max_time_in_queue_s) read out of `body` (removed from it)."""
    url = body.pop("webhook_url", None)
    if url is not None and (not isinstance(url, str) or not url):
        raise _bad("webhook_url must be a non-empty string (an http:// or https:// URL)", "webhook_url")
    priority = body.pop("priority", None)
    if priority is None:
        priority = DEFAULT_ASYNC_PRIORITY
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in PRIORITIES:
        raise _bad(
            f"priority must be an integer from {PRIORITIES[0]} (first) to {PRIORITIES[-1]}", "priority"
        )
    wait = body.pop("max_time_in_queue_s", None)
    if wait is None:
        wait = config.async_queue_default_s
    if (
        isinstance(wait, bool)
        or not isinstance(wait, (int, float))
        or not 0 < wait <= config.async_queue_max_s
    ):
        raise _bad(
            f"max_time_in_queue_s must be a number of seconds above 0 and at most {config.async_queue_max_s:g}",
            "max_time_in_queue_s",
        )
    return url, priority, float(wait)


class AsyncApi:
    """The async endpoints of one gateway, over the batch side's store."""

    def __init__(self, service: BatchService, *, resolve: Resolver, can_sign: bool) -> None:
        self.service = service
        self.allow = AllowList.parse(service.config.webhook_allow)
        self.resolve = resolve
        self.can_sign = can_sign  # the gateway holds the webhook master secret

    @property
    def config(self) -> BatchConfig:
        return self.service.config

    def routes(self) -> list[Route]:
        def create(endpoint: Endpoint) -> Callable[[Request], Any]:
            async def handler(request: Request) -> Response:
                return await self.create(request, endpoint)

            return guarded(handler)

        return [
            *(
                Route(f"/v1/async{path.removeprefix('/v1')}", create(ep), methods=["POST"])
                for ep, path in PATHS.items()
            ),
            Route("/v1/async/requests/{request_id}", guarded(self.get), methods=["GET"]),
        ]

    async def create(self, request: Request, endpoint: Endpoint) -> Response:
        key = self.service.hooks.authenticate(request)
        item, record = await self._admit(request, key, endpoint)
        store = self.service.require_store()
        created = await store.create_async(record)
        try:
            await store.enqueue([item])
        except Exception as err:  # not queued: the record must not wait as queued forever
            log.warning("async request %s not queued (%s: %s)", record.id, type(err).__name__, err)
            failed = record.model_copy(update={"status": "failed", "finished_at": int(self.service.clock())})
            with contextlib.suppress(Exception):
                await store.update_async(failed, created.revision)
            raise store_unavailable(" (the request could not be queued)") from None
        return json_of(record.public(), 202)

    async def _admit(
        self, request: Request, key: ApiKeyRecord, endpoint: Endpoint
    ) -> tuple[WorkItem, AsyncRecord]:
        raw = await read_body(request, self.service.hooks.max_line_bytes)
        try:
            body = load_json(raw)
        except InputError as err:
            raise _bad(str(err)) from None
        if not isinstance(body, dict):
            raise _bad("The request body must be a JSON object")
        url, priority, wait = async_fields(body, self.config)
        info = await parse_off_loop(json.dumps(body, ensure_ascii=False).encode(), endpoint)
        if info.stream:
            raise _bad("An async request cannot stream: drop 'stream' or set it false", "stream")
        deployment = self.service.hooks.deployment_of(key.key_id, info.deployment)
        if url is not None:
            await self._check_webhook(url)
        now = self.service.clock()
        request_id = new_async_id()
        item = WorkItem(
            id=result_key(request_id, None),
            kind="async",
            parent_id=request_id,
            custom_id=request_id,
            endpoint=PATHS[endpoint],
            body=body,
            key_id=key.key_id,
            deployment=deployment,
            priority=priority,
            enqueued_at=now,
            not_after=now + wait,
        )
        record = AsyncRecord(
            id=request_id,
            endpoint=PATHS[endpoint],
            model=info.deployment,
            priority=priority,
            created_at=int(now),
            max_time_in_queue_s=wait,
            webhook_url=url,
            delivery="pending" if url is not None else "none",
            key_id=key.key_id,
            cluster=self.service.hooks.cluster,
        )
        return item, record

    async def _check_webhook(self, url: str) -> None:
        if not self.can_sign:
            raise _bad(
                "This gateway has no webhook signing secret (the cluster's credential bundle lacks "
                "webhook-master), so it cannot deliver webhooks; retrieve the result with "
                "GET /v1/async/requests/{id} instead",
                "webhook_url",
                "webhooks_unavailable",
            )
        try:
            await check(url, self.allow, self.resolve)
        except Refused as err:
            raise _bad(str(err), "webhook_url", "invalid_webhook_url") from None

    async def get(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        key = self.service.hooks.authenticate(request)
        store = self.service.require_store()
        try:
            record = (await store.async_request(request_id)).value
        except NotFound:
            record = None
        if record is None or record.key_id != key.key_id:
            raise GatewayError(
                404, f"No async request found with id '{request_id}'", code="not_found", param="id"
            )
        result = None
        if record.result_expires_at is None or self.service.clock() < record.result_expires_at:
            stored = await store.result(result_key(request_id, None))
            result = stored.line if stored is not None else None
        return json_of(record.public(result))


async def finish_async_record(
    store: BatchStore, request_id: str, status: AsyncStatus, config: BatchConfig, now: float
) -> AsyncRecord | None:
    """The worker's step once an async request's result is stored (`put_result`, before the
    work item's ack): the record finished at `now` (compare-and-set, read again when the
    record moved), its result kept for `result_retention_s`, and its webhook queued when it
    has one. Idempotent: a re-run finds the record finished and only queues the webhook
    again (the queue drops the duplicate; a settled delivery is not sent twice). None when
    the record is gone."""
    for _ in range(10):
        try:
            current = await store.async_request(request_id)
        except NotFound:
            return None
        record = current.value
        if record.status in ASYNC_TERMINAL:
            break
        finished = record.model_copy(
            update={
                "status": status,
                "finished_at": int(now),
                "result_expires_at": int(now + config.result_retention_s),
            }
        )
        try:
            record = (await store.update_async(finished, current.revision)).value
            break
        except Conflict:
            continue
    else:
        raise Conflict(request_id)
    if record.webhook_url is not None:
        await store.enqueue_webhook(request_id)
    return record


def async_expired_line(request_id: str) -> LineResult:
    """The result of an async request that waited in the queue past its max_time_in_queue_s."""
    error = LineError(
        code="expired", message="The request waited in the queue longer than max_time_in_queue_s."
    )
    return LineResult(id=request_id, custom_id=request_id, error=error)


async def expire_queued_async(store: BatchStore, config: BatchConfig, now: float, cluster: str = "") -> int:
    """Expire every async request still queued past its max_time_in_queue_s: a request
    no worker pulls (no capacity, no replica) is otherwise checked only when dispatched.
    Its `expired` result is stored create-once (a worker that stored one first wins, and
    the record takes that one's status) and its record finished (its webhook queued). Any
    gateway may run it at once with another: every step is idempotent. The number expired."""
    expired = 0
    for record in await store.async_requests():
        if record.status != "queued" or now < record.created_at + 1 + record.max_time_in_queue_s:
            continue  # created_at is whole seconds: the item's own not_after is at most 1 s later
        key = result_key(record.id, None)
        line = async_expired_line(record.id)
        if not await store.put_result(key, StoredResult(line=line, cluster=cluster)):
            stored = await store.result(key)
            line = stored.line if stored is not None else line
        status: AsyncStatus = "expired"
        if line.error is None or line.error.code != "expired":
            status = "succeeded" if line.ok else "failed"
        await finish_async_record(store, record.id, status, config, now)
        expired += status == "expired"
    return expired
