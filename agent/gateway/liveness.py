"""Which clusters are alive right now, heard directly, and the sticky canary draw.

Routes from the control plane drop a silent cluster only after it declares it unhealthy
and the agent rewrites routes.json (seconds). A gateway that hears every cluster's
heartbeat (`fleet.v1.heartbeat.*`, each second) knows sooner: a cluster silent for
`dead_after_s` while this gateway's own NATS link is up is dead to it, and a forward
that fails to connect marks a peer down at once until it is heard again. While the
link is down (a partition) nothing is judged: the cached routes and replicas stand.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

from fleet_base.domain import is_cluster_id
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import HEARTBEAT_WILDCARD
from fleet_base.wire import subject_cluster

log = logging.getLogger(__name__)

SESSION_HEADER = "x-fleet-session"
DEAD_AFTER_S = 1.8


class LivenessBook:
    """Last time each cluster was heard, and failed forwards; no I/O."""

    def __init__(
        self,
        dead_after_s: float = DEAD_AFTER_S,
        down_for_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dead_after_s = dead_after_s
        self.down_for_s = down_for_s
        self.clock = clock
        self.heard: dict[str, float] = {}
        self.down: dict[str, float] = {}  # cluster -> when a forward to it failed to connect
        self.listening_since: float | None = None  # None: not connected, judge nothing

    def listening(self, on: bool) -> None:
        self.listening_since = self.clock() if on else None

    def seen(self, cluster: str) -> None:
        self.heard[cluster] = self.clock()

    def mark_down(self, cluster: str) -> None:
        """A forward failed to connect: skip the peer for down_for_s (its agent may still
        heartbeat while its gateway is gone, so hearing it does not lift this)."""
        self.down[cluster] = self.clock()

    def alive(self, cluster: str) -> bool:
        """False for down_for_s after a failed forward, or when the cluster has been silent
        for dead_after_s while we could hear it."""
        now = self.clock()
        failed_at = self.down.get(cluster)
        if failed_at is not None:
            if now - failed_at < self.down_for_s:
                return False
            del self.down[cluster]
        if self.listening_since is None:
            return True
        if now - self.listening_since < self.dead_after_s:
            return True  # just (re)connected: give everyone a chance to be heard
        last = self.heard.get(cluster)
        if last is None:
            return True  # never heard (routes name it only): trust the routes
        return now - last < self.dead_after_s

    def silent(self, cluster: str) -> bool:
        """Heard before, and silent for dead_after_s now while we listen."""
        if self.listening_since is None or cluster not in self.heard:
            return False
        now = self.clock()
        return (
            now - self.listening_since >= self.dead_after_s and now - self.heard[cluster] >= self.dead_after_s
        )


class PeerLiveness(LivenessBook):
    """A LivenessBook fed by the gateway's NATS link."""

    def __init__(self, link: NatsLink | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.link = link
        self._nc: object | None = None
        if link is not None:
            link.on_connect(self._on_connect)

    async def _on_connect(self) -> None:
        """Every (re)connect: subscribe once per connection, start listening afresh."""
        link = self.link
        if link is not None and link.nc is not None and self._nc is not link.nc:
            self._nc = link.nc
            await link.subscribe(HEARTBEAT_WILDCARD, self._on_heartbeat)
        self.listening(True)

    async def _on_heartbeat(self, msg) -> None:
        """A message on `fleet.v1.heartbeat.<c>` is c heard: only c's agent may publish
        there (NATS permissions), so liveness needs no parse of a body that may be large."""
        cluster = subject_cluster(msg.subject)
        if is_cluster_id(cluster):
            self.seen(cluster)

    def _sync(self) -> None:
        """A dropped link stops judgement at once (reconnects restart it via on_connect)."""
        if self.link is not None and not self.link.is_connected:
            self.listening_since = None

    def alive(self, cluster: str) -> bool:
        self._sync()
        return super().alive(cluster)

    def silent(self, cluster: str) -> bool:
        self._sync()
        return super().silent(cluster)


def sticky_draw(user: str | None, session: str | None) -> float | None:
    """A draw in [0, 1) fixed per end user (the request's `user` field, else the
    X-Fleet-Session header), so one conversation stays on one version while the canary
    weight holds; None when the request names neither."""
    key = user or session
    if not key:
        return None
    digest = hashlib.sha256(key.encode("utf-8", "replace")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
