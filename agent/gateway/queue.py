"""Requests waiting for a deployment to have a ready replica here.

Bounded in size and in time: a full queue or a wait past the timeout is answered 503
with Retry-After. Waiters wake on every reload of the cluster state.

`admit` also holds requests while every ready replica of the deployment is at its
concurrency target (`capacity`), and lets waiters go in priority order, keys taking turns
within a class, the overdue first (`agent.gateway.priority`); `release` frees an admitted
slot.

Per key: at most its `max_concurrent` requests hold slots here at once (the others wait
their turn), and at most `key_share` of the queue waits for one key; past that share the
key is answered 429, so one key can neither take every slot nor fill the queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable

from agent.gateway.errors import GatewayError
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.priority import DEFAULT_CLASSES, PriorityWaitlist
from agent.gateway.state import ClusterView
from fleet_base.local_state import GatewayStatus, LocalState

log = logging.getLogger("agent.gateway")


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
        # priority admission under a per-deployment concurrency target
        self.classes: tuple[str, ...] = DEFAULT_CLASSES
        self.max_age_s = 5.0
        self.capacity: Callable[[str], int | None] = lambda deployment: None
        self.clock: Callable[[], float] = time.monotonic
        self.active: dict[str, int] = {}
        self.cold_start_timeout_s = 0.0  # see wait_limit
        self.key_share = 1.0  # the fraction of `size` one key's waiters may hold
        self.key_active: collections.Counter[str] = collections.Counter()  # slots held, per key
        self._key_limits: dict[str, int | None] = {}  # max_concurrent of the keys seen lately
        self._waitlists: dict[str, PriorityWaitlist] = {}
        self._grants: dict[int, asyncio.Future[None]] = {}

    def wait_limit(self, deployment: str) -> float:
        """Seconds a request may wait here: longer while a deployment that scales to zero
        has no ready replica (a cold start is coming)."""
        route = self.view.route(deployment)
        if self.view.ready(deployment) or route is None or not route.scale_to_zero:
            return self.timeout_s
        return max(self.timeout_s, self.cold_start_timeout_s)

    def unavailable(self, deployment: str, why: str) -> GatewayError:
        return GatewayError(
            503,
            f"No replica of '{deployment}' is ready in this cluster ({why}); retry shortly",
            code="no_replica_available",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    # ------------------------------------------------------------------ priority admission

    def waitlist(self, deployment: str) -> PriorityWaitlist:
        wl = self._waitlists.get(deployment)
        if wl is None:
            wl = self._waitlists[deployment] = PriorityWaitlist(self.classes, self.max_age_s)
        return wl

    def waiting(self, deployment: str) -> int:
        """Requests of `deployment` waiting for a slot now."""
        return len(self._waitlists.get(deployment) or ())

    def key_waiting(self, key: str) -> int:
        """Requests of `key` waiting here, every deployment."""
        return sum(wl.of_key(key) for wl in self._waitlists.values())

    def key_queue_cap(self) -> int:
        """How many of one key's requests may wait here at once."""
        return max(1, math.ceil(self.size * self.key_share))

    def eligible(self, key: str) -> bool:
        """The key may take another slot (it is below its max_concurrent)."""
        limit = self._key_limits.get(key)
        return limit is None or self.key_active[key] < limit

    def would_wait(self, deployment: str) -> bool:
        """A request arriving now would queue (no slot free, or others wait already)."""
        return not self._room(deployment) or bool(self._waitlists.get(deployment))

    def class_depth(self, klass: str) -> int:
        return sum(wl.depth(klass) for wl in self._waitlists.values())

    def _room(self, deployment: str) -> bool:
        if not self.view.ready(deployment):
            return False
        target = self.capacity(deployment)
        return target is None or self.active.get(deployment, 0) < target

    def dispatch(self, deployment: str) -> None:
        """Grant free slots to waiters, best first."""
        wl = self._waitlists.get(deployment)
        while wl and self._room(deployment):
            waiter = wl.pop(self.clock(), self.eligible)
            if waiter is None:
                break
            grant = self._grants.pop(waiter.seq, None)
            if grant is not None and not grant.done():
                self._take(deployment, waiter.key)
                grant.set_result(None)

    def _take(self, deployment: str, key: str) -> None:
        self.active[deployment] = self.active.get(deployment, 0) + 1
        self.key_active[key] += 1

    def release(self, deployment: str, key: str = "") -> None:
        """An admitted request finished: free its slots (the deployment's and the key's) and
        let the next waiters in: here, and where the key's own requests wait."""
        self.active[deployment] = max(0, self.active.get(deployment, 0) - 1)
        self.key_active[key] -= 1
        if self.key_active[key] <= 0:
            del self.key_active[key]
            if not self.key_waiting(key):
                self._key_limits.pop(key, None)
        self.dispatch(deployment)
        for other, wl in list(self._waitlists.items()):
            if other != deployment and wl.of_key(key):
                self.dispatch(other)

    def _refused(self, deployment: str, reason: str, why: str, busy: str, code: str) -> GatewayError:
        """The queue's 503 (reason: full, timeout): unavailable while nothing is ready, else busy."""
        self.metrics.queue_rejected.labels(deployment, reason).inc()
        if not self.view.ready(deployment):
            return self.unavailable(deployment, why)
        return GatewayError(
            503,
            f"'{deployment}' is busy: {busy}; retry shortly",
            code=code,
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def report(self, local: LocalState, interval_s: float = 0.5) -> None:
        """Tell the agent the queue depth (gateway.json, for its heartbeat), each interval."""
        while True:
            by_class = {c: self.class_depth(c) for c in self.classes}
            status = GatewayStatus(queue_depth=self.depth, by_class=by_class)
            try:
                await asyncio.to_thread(local.save_gateway, status)
            except OSError as err:
                log.debug("cannot write %s: %s", local.gateway_path, err)  # logged once by local.writes
            await asyncio.sleep(interval_s)

    def _set_depth_metrics(self, klass: str) -> None:
        self.metrics.queue_depth.set(self.depth)
        self.metrics.queue_class_depth.labels(klass).set(self.class_depth(klass))

    def _over_share(self, deployment: str, key: str) -> GatewayError:
        """429: the key holds its whole share of the queue (and, with a max_concurrent, its slots)."""
        waiting, cap = self.key_waiting(key), self.key_queue_cap()
        limit = self._key_limits.get(key)
        if limit is not None and self.key_active[key] >= limit:
            reason = "max_concurrent"
            message = (
                f"This key already has {self.key_active[key]} requests running here (its max_concurrent is "
                f"{limit}) and {waiting} waiting, its share of this gateway's queue; retry when one finishes"
            )
        else:
            reason = "queue_share"
            message = (
                f"This key already has {waiting} requests waiting here, its share of this gateway's queue "
                f"({cap} of {self.size}); retry when one finishes"
            )
        self.metrics.rate_limited.labels(deployment, reason).inc()
        return GatewayError(
            429, message, code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)}
        )

    def _held_by_own_limit(self, deployment: str, key: str, waited_s: float) -> GatewayError:
        """429, not 503, for a wait that ends while the key's own max_concurrent still
        holds it: the limit is the client's, the server is not overloaded on its account."""
        limit = self._key_limits.get(key)
        self.metrics.rate_limited.labels(deployment, "max_concurrent").inc()
        return GatewayError(
            429,
            f"This key's max_concurrent ({limit}) requests were all running for the {waited_s:.0f} s "
            "this one waited in the gateway queue; retry when one finishes",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def admit(
        self, deployment: str, klass: str, key: str = "", max_concurrent: int | None = None
    ) -> float:
        """Take a slot of `deployment` for `key` (call `release` with both when done); the
        seconds queued. 429 past the key's share of the queue, or at the timeout while the
        key's own max_concurrent still holds it; 503 on a full queue or after the timeout."""
        start = self.clock()
        if max_concurrent is None:
            self._key_limits.pop(key, None)
        else:
            self._key_limits[key] = max_concurrent
        wl = self.waitlist(deployment)
        klass = wl.klass(klass)
        if self._room(deployment) and self.eligible(key) and wl.peek(start, self.eligible) is None:
            self._take(deployment, key)
            self.metrics.queue_time.labels(klass).observe(0.0)
            return 0.0
        if self.depth >= self.size:
            full = f"the gateway queue is full at {self.size} requests"
            raise self._refused(deployment, "full", full, full, "queue_full")
        if self.key_waiting(key) >= self.key_queue_cap():  # room, but not for this key
            raise self._over_share(deployment, key)
        loop = asyncio.get_running_loop()
        waiter = wl.add(klass, start, key)
        grant: asyncio.Future[None] = loop.create_future()
        self._grants[waiter.seq] = grant
        deadline = start + self.wait_limit(deployment)
        self.depth += 1
        self._set_depth_metrics(klass)
        admitted = False
        try:
            while True:
                self.dispatch(deployment)
                if grant.done():
                    admitted = True
                    return self.clock() - start
                remaining = deadline - self.clock()
                if remaining <= 0:
                    if not self.eligible(key):
                        raise self._held_by_own_limit(deployment, key, self.clock() - start)
                    waited = f"waited {self.timeout_s:g} s"
                    raise self._refused(
                        deployment, "timeout", waited, f"{waited} in the gateway queue", "queue_timeout"
                    )
                changed = asyncio.ensure_future(self.view.changed().wait())
                try:
                    await asyncio.wait(
                        {grant, changed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    changed.cancel()
        finally:
            wl.remove(waiter)
            self._grants.pop(waiter.seq, None)
            if not admitted and grant.done() and not grant.cancelled():
                self.release(deployment, key)  # granted, but its owner left (cancelled)
            grant.cancel()
            self.depth -= 1
            self._set_depth_metrics(klass)
            waited = self.clock() - start
            self.metrics.queue_wait.labels(deployment).observe(waited)
            self.metrics.queue_time.labels(klass).observe(waited)
