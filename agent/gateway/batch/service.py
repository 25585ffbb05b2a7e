"""The gateway's batch side in one object: the store, the Files, Batches and async routes,
and the loops that run beside the gateway (the lifecycle driver, the webhook delivery loop
when the gateway holds the webhook master secret; the workers append theirs to `loops`).

The gateway opens the store from its own NATS connection once it is up (binding the
resources the control plane created; never creating them), retrying while it cannot;
until then the routes answer 503 and the loops wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.routing import Route

from agent.gateway.batch.async_api import AsyncApi
from agent.gateway.batch.batches_api import BatchesApi
from agent.gateway.batch.driver import BatchDriver
from agent.gateway.batch.files_api import FilesApi
from agent.gateway.batch.http import store_unavailable
from agent.gateway.batch.metrics import BatchMetrics
from agent.gateway.batch.webhooks import WebhookMetrics, WebhookSender, load_master, resolve_host
from agent.gateway.errors import GatewayError
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import COMPLETION_WINDOWS, now
from fleet_base.batch.store import BatchStore
from fleet_base.batch.webhook_target import Resolver
from fleet_base.bounds import MAX_BODY_BYTES

if TYPE_CHECKING:
    from agent.gateway.gateway import Gateway
    from fleet_base.nats_io import NatsLink

log = logging.getLogger(__name__)

Loop = Callable[[BatchStore], Awaitable[None]]


@dataclass(frozen=True)
class GatewayHooks:
    """What the batch side takes from its gateway."""

    # the request's key, checked exactly as an inference request's (401/403 otherwise)
    authenticate: Callable[[Request], ApiKeyRecord]
    # (key id, model) -> the deployment the key may run it on, or the gateway's refusal
    deployment_of: Callable[[str, str], str]
    cluster: str
    registry: CollectorRegistry
    max_line_bytes: int = MAX_BODY_BYTES
    # reload what the gateway knows (keys, routes) before the driver validates with it
    refresh: Callable[[], None] = lambda: None
    # the fleet's webhook master secret (None: this gateway neither takes webhook URLs nor
    # delivers), and a key's record as last published (its webhook secret version)
    webhook_master: bytes | None = None
    key: Callable[[str], ApiKeyRecord | None] = lambda key_id: None
    resolve: Resolver = resolve_host  # webhook hosts (tests answer for names of their own)


class BatchService:
    def __init__(
        self,
        config: BatchConfig,
        hooks: GatewayHooks,
        *,
        store: BatchStore | None = None,
        open_store: Callable[[], Awaitable[BatchStore]] | None = None,
        windows: Mapping[str, float] = COMPLETION_WINDOWS,  # tests shorten "24h"; the API still takes only it
        tick_s: float = 2.0,
        clock: Callable[[], float] = now,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.store = store
        self.open_store = open_store
        self.windows = windows
        self.tick_s = tick_s
        self.clock = clock
        self.holder = f"{hooks.cluster}/{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.metrics = BatchMetrics(hooks.registry)
        self.files = FilesApi(self)
        self.batches = BatchesApi(self)
        self.async_api = AsyncApi(self, resolve=hooks.resolve, can_sign=hooks.webhook_master is not None)
        self.webhook_metrics = WebhookMetrics(hooks.registry)
        self.driver: BatchDriver | None = None
        # loops to run once the store is open, each as a task of its own (workers, webhooks)
        self.loops: list[Loop] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.ready = asyncio.Event()
        if hooks.webhook_master is not None:
            self.loops.append(self.webhooks)

    def routes(self) -> list[Route]:
        return self.files.routes() + self.batches.routes() + self.async_api.routes()

    async def webhooks(self, store: BatchStore) -> None:
        """The webhook delivery loop (every gateway that can sign runs one)."""
        sender = WebhookSender(
            store,
            self.config,
            self.hooks.key,
            self.hooks.webhook_master,
            self.webhook_metrics,
            resolve=self.hooks.resolve,
            clock=self.clock,
        )
        await sender.run()

    def require_store(self) -> BatchStore:
        if self.store is None:
            raise store_unavailable(" (not bound yet)")
        return self.store

    def window_s(self, window: str) -> float:
        return self.windows.get(window, COMPLETION_WINDOWS[window])

    def wake(self) -> None:
        if self.driver is not None:
            self.driver.wake()

    async def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._run(), name="batch-service"))

    async def stop(self) -> None:
        for task in self.tasks:  # the driver's scan first: it must not claim anything anew
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        if self.driver is not None:
            await self.driver.stop()  # its batches' claims handed back

    async def _run(self) -> None:
        delay = 1.0
        while self.store is None:
            assert self.open_store is not None, "a BatchService needs a store or a way to open one"
            try:
                self.store = await self.open_store()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning(
                    "batch store not available yet (%s: %s); retrying in %.0fs",
                    type(err).__name__,
                    err,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)
        self.driver = BatchDriver(
            self.store,
            self.config,
            self.hooks.deployment_of,
            holder=self.holder,
            metrics=self.metrics,
            windows=self.windows,
            tick_s=self.tick_s,
            clock=self.clock,
            max_line_bytes=self.hooks.max_line_bytes,
            refresh=self.hooks.refresh,
        )
        self.tasks.append(asyncio.create_task(self.driver.run(), name="batch-driver"))
        for loop in self.loops:
            self.tasks.append(
                asyncio.create_task(loop(self.store), name=f"batch-{getattr(loop, '__name__', 'loop')}")
            )
        self.ready.set()


async def open_nats_store(link: NatsLink, config: BatchConfig) -> BatchStore:
    """The store on the gateway's NATS connection, once it is up."""
    from fleet_base.batch.nats_store import open_batch_store  # the NATS client only where a gateway runs

    link.start()
    while not await link.wait_connected(timeout=5.0):
        pass
    assert link.nc is not None
    return await open_batch_store(link.nc, config)


def gateway_hooks(gw: Gateway) -> GatewayHooks:
    """The gateway's own checks, as the batch side calls them."""

    def authenticate(request: Request) -> ApiKeyRecord:
        gw.refresh()
        record = gw.auth.authenticate(request.headers.get("authorization"))
        gw.auth.authorize(record)
        gw.residency.admit_key(record)
        return record

    def deployment_of(key_id: str, model: str) -> str:
        """As `Gateway._call` decides it: an adapter's deployment, the key allowed it, known."""
        record = gw.view.keys.get(key_id)
        if record is None or record.revoked:
            raise GatewayError(
                401, f"The batch's API key '{key_id}' is unknown or revoked", code="invalid_api_key"
            )
        gw.auth.authorize(record)
        known = gw.view.known(model)
        deployment = model if known else gw.adapters.resolve(gw.view.replicas, model)
        if deployment is None:
            gw.auth.authorize(record, model)
            raise GatewayError(
                404,
                f"The model '{model}' does not exist (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        gw.auth.authorize(record, deployment)
        return deployment

    return GatewayHooks(
        authenticate=authenticate,
        deployment_of=deployment_of,
        cluster=gw.cluster,
        registry=gw.metrics.registry,
        refresh=gw.refresh,
        max_line_bytes=gw.config.gateway.max_body_bytes,
        webhook_master=load_master(gw.config.security.webhook_master_file),
        key=lambda key_id: gw.view.keys.get(key_id),
    )
