"""Usage records to `fleet.v1.usage.<cluster>`, best effort.

A request only enqueues its record (never awaits NATS). One task publishes them while
NATS is up; while it is down records wait in a bounded buffer and the oldest are dropped
once it is full, so serving never depends on NATS.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from agent.gateway.metrics import GatewayMetrics
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import UsageRecord, usage_subject

log = logging.getLogger(__name__)


class UsagePublisher:
    def __init__(
        self, link: NatsLink | None, cluster: str, metrics: GatewayMetrics, max_buffered: int = 10_000
    ) -> None:
        self.link = link
        self.subject = usage_subject(cluster)
        self.metrics = metrics
        self._buffer: collections.deque[UsageRecord] = collections.deque()
        self._max = max_buffered
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.link is not None and self._task is None:
            self.link.start()
            self._task = asyncio.create_task(self._run(), name="usage-publisher")

    def submit(self, record: UsageRecord) -> None:
        if self.link is None:
            return
        if len(self._buffer) >= self._max:
            self._buffer.popleft()
            self.metrics.usage_records.labels("dropped").inc()
        self._buffer.append(record)
        self._wake.set()

    async def _run(self) -> None:
        assert self.link is not None
        while True:
            if not self._buffer:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self.link.is_connected:
                await self.link.wait_connected(timeout=1.0)
                continue
            record = self._buffer[0]
            if await self.link.publish(self.subject, record):
                self._buffer.popleft()
                self.metrics.usage_records.labels("published").inc()
            else:
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.link is not None:
            if self.link.nc is not None and self.link.is_connected:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.link.nc.flush(), 1.0)
            await self.link.close()
