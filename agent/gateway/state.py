"""The gateway's view of its cluster, read from the files the agent writes.

Each file is reloaded when its signature (inode, mtime, size) changes; the agent writes by
atomic rename, so a new inode marks every rewrite even when two land within one mtime
tick. Checks are throttled (stat calls only), and a file that fails to parse keeps the
last good copy: a bad write must not log every client out or drop every replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

from fleet_base.api_keys import ApiKeyRecord
from fleet_base.local_state import KeySet, LocalState, ReplicaSnapshot, RouteSet
from fleet_base.protocol import ReplicaState, ReplicaStatus, RoutingTable

log = logging.getLogger(__name__)

Signature = tuple[int, int, int]  # (inode, mtime_ns, size); (0, 0, 0) when absent
ABSENT: Signature = (0, 0, 0)


def file_signature(path: Path) -> Signature:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ABSENT
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class ClusterView:
    """Replicas, keys and routes of one cluster as last written by its agent."""

    FILES = ("replicas", "keys", "routes")

    def __init__(
        self,
        state_dir: Path,
        *,
        min_interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = LocalState(state_dir)
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.replicas: list[ReplicaStatus] = []
        self.keys: dict[str, ApiKeyRecord] = {}
        self._keys_written_at: float | None = None
        self._lease_sig: Signature = ABSENT
        self._lease_seen_at: float | None = None
        self.routes: dict[str, RoutingTable] = {}
        self.signatures: dict[str, Signature] = {name: ABSENT for name in self.FILES}
        self.reloads: dict[str, int] = {name: 0 for name in self.FILES}
        self._checked_at = float("-inf")
        self._changed: asyncio.Event | None = None
        self.refresh(force=True)

    def _path(self, name: str) -> Path:
        return {
            "replicas": self.local.replicas_path,
            "keys": self.local.keys_path,
            "routes": self.local.routes_path,
        }[name]

    def refresh(self, force: bool = False) -> set[str]:
        """Reload changed files (at most once per min_interval_s unless forced); the names reloaded."""
        now = self.clock()
        if not force and now - self._checked_at < self.min_interval_s:
            return set()
        self._checked_at = now
        changed: set[str] = set()
        for name in self.FILES:
            sig = file_signature(self._path(name))
            if sig != self.signatures[name] and self._load(name, sig):
                self.signatures[name] = sig
                self.reloads[name] += 1
                changed.add(name)
        lease_sig = file_signature(self.local.key_lease_path)
        if lease_sig != self._lease_sig:
            self._lease_sig = lease_sig
            self._lease_seen_at = self.local.load_key_lease()
        if changed and self._changed is not None:
            self._changed.set()
            self._changed = None
        return changed

    def _load(self, name: str, sig: Signature) -> bool:
        model: type[BaseModel] = {"replicas": ReplicaSnapshot, "keys": KeySet, "routes": RouteSet}[name]
        if sig == ABSENT:
            parsed: BaseModel | None = None
        else:
            try:
                parsed = model.model_validate_json(self._path(name).read_bytes())
            except FileNotFoundError:
                parsed = None
            except (ValidationError, ValueError, OSError) as err:
                log.warning("keeping the last good %s: %s does not parse: %s", name, self._path(name), err)
                return False
        if name == "replicas":
            self.replicas = parsed.replicas if isinstance(parsed, ReplicaSnapshot) else []
        elif name == "keys":
            self.keys = parsed.keys if isinstance(parsed, KeySet) else {}
            self._keys_written_at = sig[1] / 1e9 if parsed is not None else None
        else:
            self.routes = parsed.routes if isinstance(parsed, RouteSet) else {}
        return True

    @property
    def keys_confirmed_at(self) -> float | None:
        """Wall clock of the agent's last confirmation of the key set: when it last heard
        the lease renewed, else (no lease seen yet) when it wrote keys.json."""
        if self._lease_seen_at is not None:
            return max(self._lease_seen_at, self._keys_written_at or 0.0)
        return self._keys_written_at

    def changed(self) -> asyncio.Event:
        """An event set at the next reload of any file (for requests waiting on a replica)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def watch(self, interval_s: float | None = None) -> None:
        """Poll the files forever so waiters wake without a request arriving."""
        interval = interval_s or self.min_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                self.refresh(force=True)
            except Exception:  # never let the poller die
                log.exception("reloading the cluster state failed")

    # ------------------------------------------------------------------ queries

    def ready(self, deployment: str) -> list[ReplicaStatus]:
        return [
            r for r in self.replicas if r.deployment == deployment and r.state == ReplicaState.ready and r.url
        ]

    def has_replicas(self, deployment: str) -> bool:
        """Any replica here that is or may become ready (not failed or stopped)."""
        live = (ReplicaState.pending, ReplicaState.starting, ReplicaState.ready)
        return any(r.deployment == deployment and r.state in live for r in self.replicas)

    def route(self, deployment: str) -> RoutingTable | None:
        return self.routes.get(deployment)

    def known(self, deployment: str) -> bool:
        return deployment in self.routes or self.has_replicas(deployment)

    def deployments(self) -> list[str]:
        """What /v1/models lists: deployments ready here or routed from here."""
        names = {r.deployment for r in self.replicas if r.state == ReplicaState.ready and r.url}
        return sorted(names | set(self.routes))
