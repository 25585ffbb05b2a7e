"""The gateway's LoRA side: which deployment an adapter name belongs to, which replicas hold
it (the agent's reports, plus what this gateway loaded since), and loading it on the
replica the plan chose, evicting that replica's least recently used adapter when full.

Loads on one replica are serialized, so two requests for a cold adapter load it once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter

from agent.adapters import ReplicaAdapters, eviction_victim
from agent.gateway.inputs import RequestInfo
from fleet_base.protocol import ReplicaStatus

OUTCOMES = ("resident", "loaded", "evicted", "failed")


class AdapterRouting:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.api: ReplicaAdapters | None = None  # set when the gateway's HTTP client exists
        self._loaded: dict[str, set[str]] = {}  # replica id -> adapters this gateway loaded
        self._dropped: dict[str, set[str]] = {}  # replica id -> adapters this gateway evicted
        self._last_used: dict[tuple[str, str], float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.routed = Counter(
            "fleet_gateway_adapter_requests",
            "LoRA adapter requests by where they went: resident (a replica held it), loaded (into "
            "a replica with room), evicted (another adapter made room), failed (the load failed).",
            ["deployment", "outcome"],
            registry=registry,
        )

    def know(self, deployment: str) -> None:
        """A deployment's outcome series at zero, so its hit-rate panel has series from the start."""
        for outcome in OUTCOMES:
            self.routed.labels(deployment, outcome)

    @staticmethod
    def resolve(replicas: Iterable[ReplicaStatus], name: str) -> str | None:
        """The deployment whose adapter catalog has `name` (None: not an adapter here)."""
        return next((r.deployment for r in replicas if name in r.adapter_uris), None)

    @classmethod
    def split(
        cls, replicas: Iterable[ReplicaStatus], known: bool, info: RequestInfo
    ) -> tuple[str | None, RequestInfo]:
        """A `model` that names a LoRA adapter here (not a `known` deployment): (the adapter,
        the request as its deployment's); anything else is left as it is."""
        owner = None if known else cls.resolve(replicas, info.deployment)
        if owner is None:
            return None, info
        return info.deployment, replace(info, deployment=owner)

    @staticmethod
    def catalog(replicas: Iterable[ReplicaStatus]) -> dict[str, str]:
        """adapter name -> its deployment, over this cluster's replicas."""
        return {a: r.deployment for r in replicas for a in r.adapter_uris}

    def resident(self, r: ReplicaStatus) -> frozenset[str]:
        """Adapters on `r`: the agent's last report, corrected by this gateway's own loads."""
        have = (set(r.adapters) | self._loaded.get(r.replica_id, set())) - self._dropped.get(
            r.replica_id, set()
        )
        return frozenset(have)

    def observe(self, replicas: Iterable[ReplicaStatus]) -> None:
        """A new agent report supersedes the corrections it already reflects."""
        for r in replicas:
            reported = set(r.adapters)
            if r.replica_id in self._loaded:
                self._loaded[r.replica_id] -= reported
            if r.replica_id in self._dropped:
                self._dropped[r.replica_id] &= reported

    def touch(self, replica_id: str, adapter: str) -> None:
        self._last_used[(replica_id, adapter)] = time.monotonic()

    async def ensure(self, r: ReplicaStatus, adapter: str) -> str:
        """Make `adapter` resident on `r`; the outcome (one of OUTCOMES)."""
        rid = r.replica_id
        lock = self._locks.setdefault(rid, asyncio.Lock())
        async with lock:
            if adapter in self.resident(r):
                return "resident"
            uri = r.adapter_uris.get(adapter)
            if uri is None or self.api is None:
                return "failed"
            outcome = "loaded"
            have = sorted(self.resident(r))
            if len(have) >= r.max_adapters:
                used = {a: self._last_used.get((rid, a), float("-inf")) for a in have}
                victim = eviction_victim(have, used, adapter)
                if victim is None or not await self.api.unload(r.url.rstrip("/"), victim, r.engine):
                    return "failed"
                self._dropped.setdefault(rid, set()).add(victim)
                self._loaded.get(rid, set()).discard(victim)
                outcome = "evicted"
            if not await self.api.load(r.url.rstrip("/"), adapter, uri, r.engine):
                return "failed"
            self._loaded.setdefault(rid, set()).add(adapter)
            self._dropped.get(rid, set()).discard(adapter)
            return outcome
