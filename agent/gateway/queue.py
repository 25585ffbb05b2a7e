"""Requests waiting for a deployment to have a ready replica here.

Bounded in size and in time: a full queue or a wait past the timeout is answered 503
with Retry-After. Waiters wake on every reload of the cluster state. Priority classes
(interactive before batch, issue 9) will order admission here; today every waiter
re-checks on each change, which is FIFO enough when replicas appear all at once.
"""

from __future__ import annotations

import asyncio
import time

from agent.gateway.errors import GatewayError
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.state import ClusterView


class ReplicaQueue:
    def __init__(
        self, view: ClusterView, size: int, timeout_s: float, metrics: GatewayMetrics, retry_after_s: int = 1
    ) -> None:
        self.view = view
        self.size = size
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.depth = 0

    def _unavailable(self, deployment: str, why: str) -> GatewayError:
        return GatewayError(
            503,
            f"No replica of '{deployment}' is ready in this cluster ({why}); retry shortly",
            code="no_replica_available",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def wait_ready(self, deployment: str) -> None:
        """Return once `deployment` has a ready replica; 503 on a full queue or timeout."""
        if self.view.ready(deployment):
            return
        if self.depth >= self.size:
            self.metrics.queue_rejected.labels(deployment, "full").inc()
            raise self._unavailable(deployment, f"the gateway queue is full at {self.size} requests")
        start = time.monotonic()
        deadline = start + self.timeout_s
        self.depth += 1
        self.metrics.queue_depth.set(self.depth)
        try:
            while not self.view.ready(deployment):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.queue_rejected.labels(deployment, "timeout").inc()
                    raise self._unavailable(deployment, f"waited {self.timeout_s:g} s")
                changed = self.view.changed()
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.depth -= 1
            self.metrics.queue_depth.set(self.depth)
            self.metrics.queue_wait.labels(deployment).observe(time.monotonic() - start)
