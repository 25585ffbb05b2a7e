"""The webhook delivery loop: every gateway pulls due deliveries from the store's webhook
queue and POSTs each async result to its `webhook_url`, signed per Standard Webhooks with
the owner key's secret (`fleet_base.batch.webhook_signing`).

A 2xx marks the record delivered (compare-and-set) and then acknowledges the queue message;
anything else (an error status, a redirect, which is never followed, a timeout, a refused
connection) is an attempt counted on the record and a nak with backoff (`webhook_retry`),
until `webhook_give_up_s` after the result was ready: then the delivery is `failed` and the
result stays retrievable until `result_expires_at`. The URL is checked again on every
attempt and the connection goes to the addresses vetted then, with the original Host header
and TLS server name, so DNS rebinding reaches nothing (`fleet_base.batch.webhook_target`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import certifi
import httpx
from prometheus_client import CollectorRegistry, Counter

from agent.gateway.batch.webhook_retry import Next, after_attempt, backoff_s
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import ASYNC_TERMINAL, AsyncRecord, LineResult
from fleet_base.batch.names import result_key
from fleet_base.batch.store import BatchStore, Conflict, NotFound, WebhookDelivery
from fleet_base.batch.webhook_signing import key_secret, master_path, read_master, signed_headers
from fleet_base.batch.webhook_target import AllowList, Refused, Resolver, Vetted, check

log = logging.getLogger("agent.gateway.batch.webhooks")

Outcome = Literal["delivered", "retried", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("delivered", "retried", "failed")
TIMEOUT_S = 10.0  # each phase of an attempt (the whole: twice it); the response body is never read
CONCURRENCY = 16  # deliveries in flight per gateway (a slow receiver holds only its own)
USER_AGENT = "fleet-webhooks/1"
RESTART_S = 2.0  # pause before pulling again after the webhook queue failed


async def resolve_host(host: str, port: int) -> Sequence[str]:
    """Every address `host` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def load_master(configured: Path | None) -> bytes | None:
    """The fleet's webhook master secret from the credential bundle (or FLEET_WEBHOOK_MASTER);
    None when this gateway was given none (it then refuses webhook URLs)."""
    path = master_path(configured)
    if path is None:
        return None
    try:
        return read_master(path)
    except (OSError, ValueError) as err:
        log.warning("no webhook master secret at %s: %s", path, type(err).__name__)
        return None


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "fleet_batch_webhook_deliveries",
            "Webhook delivery attempts by outcome: delivered (2xx), retried (failed, tried again "
            "later), failed (given up after webhook_give_up_s; the result stays retrievable).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.deliveries.labels(outcome)


class WebhookSender:
    def __init__(
        self,
        store: BatchStore,
        config: BatchConfig,
        keys: Callable[[str], ApiKeyRecord | None],
        master: bytes | None,
        metrics: WebhookMetrics,
        *,
        resolve: Resolver = resolve_host,
        verify: ssl.SSLContext | bool = True,
        timeout_s: float = TIMEOUT_S,
        concurrency: int = CONCURRENCY,
        clock: Callable[[], float] = time.time,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.store = store
        self.config = config
        self.keys = keys
        self.master = master
        self.metrics = metrics
        self.allow = AllowList.parse(config.webhook_allow)
        self.resolve = resolve
        self.verify = ssl.create_default_context(cafile=certifi.where()) if verify is True else verify
        self.timeout_s = timeout_s
        self.slots = asyncio.Semaphore(concurrency)
        self.clock = clock
        self.draw = draw
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Deliver until cancelled; neither a failing delivery nor the store going away
        (NATS down: pulled again after a pause) stops the loop."""
        try:
            while True:
                try:
                    async for delivery in self.store.webhook_deliveries():
                        await self.slots.acquire()
                        task = asyncio.create_task(self._one(delivery), name=f"webhook-{delivery.request_id}")
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    log.warning(
                        "webhook queue unavailable (%s: %s); pulling again shortly", type(err).__name__, err
                    )
                await asyncio.sleep(RESTART_S)
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def _one(self, delivery: WebhookDelivery) -> None:
        try:
            await self.deliver(delivery)
        except asyncio.CancelledError:
            raise
        except Exception:  # the store failed mid-way: the message comes back after its ack wait
            log.exception("webhook delivery of %s failed", delivery.request_id)
        finally:
            self.slots.release()

    async def deliver(self, delivery: WebhookDelivery) -> Outcome | None:
        """One attempt at one delivery; None when there was nothing (left) to deliver."""
        try:
            current = await self.store.async_request(delivery.request_id)
        except NotFound:
            await delivery.ack()
            return None
        record = current.value
        if record.webhook_url is None or record.delivery in ("delivered", "failed"):
            await delivery.ack()  # a duplicate of a delivery already settled
            return None
        attempt = max(delivery.attempt, record.delivery_attempts + 1)
        if record.status not in ASYNC_TERMINAL or self.master is None:
            # not finished yet (queued before its record was), or this gateway cannot sign
            if self.clock() > record.created_at + record.max_time_in_queue_s + self.config.webhook_give_up_s:
                return await self._conclude(delivery, record.id, Next("give_up"), record.delivery_attempts)
            await delivery.nak(backoff_s(attempt, self.config, self.draw()))
            return None
        stored = await self.store.result(result_key(record.id, None))
        ok = await self._attempt(record, stored.line if stored is not None else None, attempt)
        now = self.clock()
        ready_at = record.finished_at if record.finished_at is not None else now
        step = after_attempt(ok, attempt, ready_at, now, self.config, self.draw())
        return await self._conclude(delivery, record.id, step, attempt)

    async def _conclude(
        self, delivery: WebhookDelivery, request_id: str, step: Next, attempt: int
    ) -> Outcome:
        now = self.clock()
        await self._settle(request_id, step, attempt, now)
        if step.action == "retry":
            self.metrics.deliveries.labels("retried").inc()
            await delivery.nak(step.delay_s)
            return "retried"
        outcome: Outcome = "delivered" if step.action == "delivered" else "failed"
        self.metrics.deliveries.labels(outcome).inc()
        await delivery.ack()
        return outcome

    async def _attempt(self, record: AsyncRecord, line: LineResult | None, attempt: int) -> bool:
        assert record.webhook_url is not None and self.master is not None
        key = self.keys(record.key_id)
        secret = key_secret(self.master, record.key_id, key.webhook_secret_version if key else 0)
        shown = record.model_copy(update={"delivery": "pending", "delivery_attempts": attempt})
        payload = shown.public(line).model_dump_json().encode()
        try:
            vetted = await check(record.webhook_url, self.allow, self.resolve)
        except Refused as err:  # resolves elsewhere now, or not at all: tried again later
            log.info("webhook of %s not attempted: %s", record.id, err)
            return False
        headers = signed_headers(secret, record.id, payload, self.clock())
        return await post(vetted, payload, headers, self.verify, self.timeout_s)

    async def _settle(self, request_id: str, step: Next, attempt: int, now: float) -> None:
        """Record the attempt (compare-and-set; a concurrent writer, the worker finishing
        the record, makes it read again)."""
        for _ in range(5):
            try:
                current = await self.store.async_request(request_id)
            except NotFound:
                return
            update: dict[str, object] = {"delivery_attempts": max(attempt, current.value.delivery_attempts)}
            if step.action == "delivered":
                update |= {"delivery": "delivered", "delivered_at": int(now)}
            elif step.action == "give_up":
                update |= {"delivery": "failed"}
            try:
                await self.store.update_async(current.value.model_copy(update=update), current.revision)
                return
            except Conflict:
                continue
        log.warning("webhook state of %s not recorded: it kept changing", request_id)


async def post(
    vetted: Vetted,
    payload: bytes,
    headers: dict[str, str],
    verify: ssl.SSLContext | bool,
    timeout_s: float = TIMEOUT_S,
) -> bool:
    """POST to the vetted addresses in turn until one answers; True on a 2xx. The request
    connects to the address itself; the Host header and TLS server name (SNI and the
    certificate check) are the URL's host. No proxy, no redirect, no response body."""
    url = vetted.url
    sni = url.scheme == "https" and url.literal is None
    extensions = {"sni_hostname": url.host} if sni else {}
    send = {
        **headers,
        "content-type": "application/json",
        "host": url.host_header,
        "user-agent": USER_AGENT,
    }
    async with httpx.AsyncClient(
        verify=verify, timeout=timeout_s, follow_redirects=False, trust_env=False
    ) as client:
        for address in vetted.addresses:
            request = client.build_request(
                "POST", url.url_for(address), content=payload, headers=send, extensions=extensions
            )
            try:
                # each phase is bounded by `timeout`; the whole attempt too (a receiver that
                # drips its headers holds a delivery slot no longer)
                response = await asyncio.wait_for(client.send(request, stream=True), 2 * timeout_s)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                continue  # nothing was sent: the next address may answer
            except (httpx.TransportError, asyncio.TimeoutError):
                return False  # it may have arrived: only a later attempt sends it again
            await response.aclose()
            return 200 <= response.status_code < 300
    return False
