"""Demand signals from the gateway to the control plane's autoscaler.

A request that has to wait for a replica is counted here while it waits; the gateway
publishes `Demand(deployment, queued, ready)` on `fleet.v1.demand.<cluster>` when such a
request arrives (at once when the deployment has no ready replica here: that is the
scale-from-zero trigger) and then at most every `DEMAND_EVERY_S` while any wait. Publishing
never blocks a request: messages go through a task, and without NATS nothing is sent (the
request still waits in the bounded queue).

Batch and async work queued in the store for a deployment (its backlog, which the batch
worker reads) is demand too: it goes as `batch_backlog` beside the requests waiting here
(`queued`), since every gateway reads the same shared queue and the control plane counts it
once; a backlog with no ready replica here is sent at once, so queued work scales a
deployment from zero."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from fleet_base.nats_io import NatsLink
from fleet_base.protocol import Demand, demand_subject

log = logging.getLogger(__name__)

DEMAND_EVERY_S = 0.5


class DemandSignal:
    def __init__(
        self,
        link: NatsLink | None,
        cluster: str,
        ready: Callable[[str], int] = lambda deployment: 0,
        every_s: float = DEMAND_EVERY_S,
    ) -> None:
        self.link = link
        self.ready = ready
        self.cluster = cluster
        self.every_s = every_s
        self.queued: dict[str, int] = {}
        self.backlogs: dict[str, int] = {}  # work items queued in the batch store
        self._last: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0

    @contextlib.contextmanager
    def waiting(self, deployment: str, ready: int) -> Iterator[None]:
        """Count one request waiting for `deployment` while the block runs."""
        self.queued[deployment] = self.queued.get(deployment, 0) + 1
        now = time.monotonic()
        if ready == 0 or now - self._last.get(deployment, -1e9) >= self.every_s:
            self._last[deployment] = now
            self._send(self.message(deployment, ready))
        try:
            yield
        finally:
            left = self.queued.get(deployment, 1) - 1
            if left > 0:
                self.queued[deployment] = left
            else:
                self.queued.pop(deployment, None)

    def message(self, deployment: str, ready: int) -> Demand:
        return Demand(
            cluster=self.cluster,
            deployment=deployment,
            queued=self.queued.get(deployment, 0),
            ready=ready,
            batch_backlog=self.backlogs.get(deployment, 0),
        )

    def backlog(self, deployment: str, items: int) -> None:
        """The batch store's backlog of `deployment` now; sent at once when it appears while
        no replica is ready here (scale from zero), then with the waiting requests."""
        before = self.backlogs.get(deployment, 0)
        if items > 0:
            self.backlogs[deployment] = items
        else:
            self.backlogs.pop(deployment, None)
        if items > 0 and before == 0:
            ready = self.ready(deployment)
            now = time.monotonic()
            if ready == 0 or now - self._last.get(deployment, -1e9) >= self.every_s:
                self._last[deployment] = now
                self._send(self.message(deployment, ready))

    def _send(self, message: Demand) -> None:
        if self.link is None:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._publish(message))
        except RuntimeError:
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, message: Demand) -> None:
        assert self.link is not None
        if await self.link.publish(demand_subject(self.cluster), message):
            self.sent += 1
        else:
            log.debug("demand for %s not sent (NATS down)", message.deployment)

    async def repeat(self) -> None:
        """While requests wait, re-send their counts every `every_s` (run as a task)."""
        while True:
            await asyncio.sleep(self.every_s)
            now = time.monotonic()
            for deployment in sorted(self.queued.keys() | self.backlogs.keys()):
                if now - self._last.get(deployment, -1e9) >= self.every_s:
                    self._last[deployment] = now
                    self._send(self.message(deployment, self.ready(deployment)))
