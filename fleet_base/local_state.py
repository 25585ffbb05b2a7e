"""The cluster's state on local disk: what the agent last saw from the control plane
(desired replicas, routes, keys) and what it runs now (replica endpoints).

The agent writes, the gateway reads; both survive a restart while NATS or the control
plane is unreachable. Writes are atomic (temp file, fsync, rename) so a reader never
sees half a file, and a write that fails (a full disk) raises after it is counted in
`LocalState.writes`: the caller keeps the newer state in memory and writes it again later.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from fleet_base.api_keys import ApiKeyRecord
from fleet_base.protocol import DesiredState, Message, ReplicaStatus, RoutingTable

log = logging.getLogger(__name__)


class RouteSet(Message):
    routes: dict[str, RoutingTable] = Field(default_factory=dict)


class KeySet(Message):
    keys: dict[str, ApiKeyRecord] = Field(default_factory=dict)


class BucketFence(BaseModel):
    """The highest control-plane epoch the agent saw in one KV bucket, and how many values
    of a lower epoch it refused there (agent.fencing)."""

    epoch: int = Field(0, ge=0)
    refused: int = Field(0, ge=0)


class FenceState(Message):
    """fence.json: per KV bucket, the epoch below which the agent obeys nothing; kept
    across restarts so a stale leader's write cannot slip in while the agent starts."""

    buckets: dict[str, BucketFence] = Field(default_factory=dict)


class KeyLeaseSeen(Message):
    """keys-lease.json: the agent's own clock when it last heard the key set's lease
    renewed, i.e. how old keys.json may be (the gateway's staleness rule, docs/security.md).
    A file of its own so a renewal every few seconds does not rewrite the whole key set."""

    seen_at: float


class ReplicaSnapshot(Message):
    """The replicas this cluster runs now, as the agent last saw them."""

    cluster: str
    replicas: list[ReplicaStatus] = Field(default_factory=list)
    updated_at: float = Field(default_factory=time.time)


class GatewayStatus(Message):
    """What the gateway tells its agent (for the heartbeat): requests queued here now."""

    queue_depth: int = 0
    by_class: dict[str, int] = Field(default_factory=dict)
    updated_at: float = Field(default_factory=time.time)


def atomic_write(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, or OSError (ENOSPC on a full disk) with `path` unchanged."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def overwrite_in_place(path: Path, data: bytes) -> bool:
    """The fallback of a full disk: `data` written over `path`'s own blocks (no larger than
    it, so no new space is needed where blocks are overwritten in place), then the file cut
    to its length. A reader may see the new text followed by old bytes for a moment, which
    does not parse: readers keep their last good copy then (the gateway does). False when
    it could not (a larger `data`, a copy-on-write filesystem that is full as well)."""
    try:
        if path.stat().st_size < len(data):
            return False
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        view = memoryview(data)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class WriteFailures:
    """State files whose last write failed, and how many writes failed in all.

    Loud once per episode: the first failure of a file logs an error, later ones of the
    same episode only count, and the first success after them logs that it recovered.
    The agent reports `failing` in its heartbeat, so a full disk shows in `fleetctl`."""

    def __init__(self) -> None:
        self.total = 0
        self.failing: dict[str, str] = {}  # file name -> why its last write failed
        self.in_place: set[str] = set()  # files last written in place (out of space)

    def failed(self, path: Path, err: OSError, *, in_place: bool = False) -> None:
        """A failed atomic write of `path`; `in_place`: its data reached the file all the
        same, written over the old one (counted and logged, but the file is current)."""
        self.total += 1
        if in_place:
            if self.failing.pop(path.name, None) is None and path.name not in self.in_place:
                log.error("cannot write %s (%s): written over the old file in place", path, err.strerror)
            self.in_place.add(path.name)
            return
        if path.name not in self.failing:
            log.error(
                "cannot write %s (%s): what is on disk stays behind what this process "
                "acts on until a write succeeds; retrying",
                path,
                err.strerror or err,
            )
        self.failing[path.name] = errno.errorcode.get(err.errno or 0, "") or type(err).__name__

    def succeeded(self, path: Path) -> None:
        self.in_place.discard(path.name)
        if self.failing.pop(path.name, None) is not None:
            log.warning("writing %s works again", path)


class _InStateDir:
    """A path under the state_dir, as a read-only attribute."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, state: LocalState, owner: type | None = None) -> Path:
        return state.dir / self.name


class LocalState:
    """Typed access to the files under a cluster's state_dir."""

    desired_path = _InStateDir("desired.json")
    routes_path = _InStateDir("routes.json")
    keys_path = _InStateDir("keys.json")
    key_lease_path = _InStateDir("keys-lease.json")
    replicas_path = _InStateDir("replicas.json")
    gateway_path = _InStateDir("gateway.json")
    fence_path = _InStateDir("fence.json")
    logs_dir = _InStateDir("logs")
    kv_events_dir = _InStateDir("kv-events")  # vLLM's and SGLang's ipc:// sockets (0700)

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.writes = WriteFailures()

    def save_fence(self, fence: FenceState) -> None:
        self._write(self.fence_path, fence)

    def load_fence(self) -> FenceState:
        return self._read(self.fence_path, FenceState) or FenceState()

    def save_gateway(self, status: GatewayStatus) -> None:
        self._write(self.gateway_path, status)

    def load_gateway(self, max_age_s: float = 5.0) -> GatewayStatus | None:
        """The gateway's last status, if it is fresh (a stopped gateway queues nothing)."""
        status = self._read(self.gateway_path, GatewayStatus)
        if status is None or time.time() - status.updated_at > max_age_s:
            return None
        return status

    def _write(self, path: Path, message: BaseModel) -> None:
        self.write_bytes(path, message.model_dump_json(indent=1).encode())

    def write_bytes(self, path: Path, data: bytes) -> None:
        """`atomic_write`, counted in `writes` (raises its OSError). Out of space, new text no
        longer than the old is written over the old file instead: a revocation, which only
        shrinks keys.json, then reaches the gateway even on a full disk."""
        try:
            atomic_write(path, data)
        except OSError as err:
            in_place = err.errno in NO_SPACE and overwrite_in_place(path, data)
            self.writes.failed(path, err, in_place=in_place)
            if not in_place:
                raise
            return
        self.writes.succeeded(path)

    def _read(self, path: Path, model: type[BaseModel]):
        try:
            return model.model_validate_json(path.read_bytes())
        except (FileNotFoundError, ValidationError, ValueError):
            return None

    def save_desired(self, desired: DesiredState) -> None:
        self._write(self.desired_path, desired)

    def load_desired(self) -> DesiredState | None:
        return self._read(self.desired_path, DesiredState)

    def save_routes(self, routes: RouteSet) -> None:
        self._write(self.routes_path, routes)

    def load_routes(self) -> RouteSet:
        return self._read(self.routes_path, RouteSet) or RouteSet()

    def save_keys(self, keys: KeySet) -> None:
        self._write(self.keys_path, keys)

    def save_key_lease(self, seen_at: float) -> None:
        self._write(self.key_lease_path, KeyLeaseSeen(seen_at=seen_at))

    def load_key_lease(self) -> float | None:
        seen = self._read(self.key_lease_path, KeyLeaseSeen)
        return seen.seen_at if seen is not None else None

    def load_keys(self) -> KeySet:
        return self._read(self.keys_path, KeySet) or KeySet()

    def save_replicas(self, snapshot: ReplicaSnapshot) -> None:
        self._write(self.replicas_path, snapshot)

    def load_replicas(self) -> ReplicaSnapshot | None:
        return self._read(self.replicas_path, ReplicaSnapshot)

    def mtime(self, path: Path) -> float:
        try:
            return path.stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            return 0.0
