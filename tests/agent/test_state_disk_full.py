"""A full disk on an agent: a revocation and a desired-state update pushed through a real
nats-server take effect in memory, the revocation reaches keys.json all the same (written
over the old file, which it only shrinks), what could not be written is reported (error
log once per episode, the heartbeat) and reaches disk once there is room again (nothing
is lost as "seen"); where keys.json cannot be written at all, the key set's lease is not
confirmed, so the gateway's key set goes stale instead of trusting the revoked key.

The full disk is ENOSPC from `os.fsync` of every new file in the state folder (the atomic
writes' temporary files), as a filesystem with delayed allocation answers when the data
is flushed; overwriting a file's own blocks needs no space and goes through."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.daemon import Agent
from fleet_base import api_keys, local_state, protocol
from fleet_base.api_keys import ApiKeyRecord, hash_secret, new_secret
from fleet_base.local_state import LocalState
from fleet_base.nats_io import NatsLink, ensure_jetstream
from fleet_base.protocol import DesiredState, ReplicaSpec
from tests.agent.conftest import cluster_config
from tests.agent.test_agent_inprocess import ScriptedRuntime
from tests.polling import eventually

CLUSTER = "test-east"


class FullDisk:
    """`os.fsync` answers ENOSPC for new files under `folder` (the temporary copies of the
    files named in `names`, all when None) while `full` is set; every other goes through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.folder = str(folder.resolve())
        self.full = False
        self.names: set[str] | None = None
        self.refused = 0
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if self.full and self._refuses(fd):
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def _refuses(self, fd: int) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        if not path.startswith(self.folder + os.sep) or not os.path.basename(path).startswith("."):
            return False
        return self.names is None or any(f".{name}." in path for name in self.names)


def record(key_id: str, **changes: object) -> ApiKeyRecord:
    salt, digest = hash_secret(new_secret()[1])
    return ApiKeyRecord(key_id=key_id, name="t", salt=salt, hash=digest, scopes=["inference"], **changes)


def spec(rid: str) -> ReplicaSpec:
    return ReplicaSpec(replica_id=rid, deployment="d", version=1, model="m")


@contextlib.asynccontextmanager
async def control(nats_url: str) -> AsyncIterator[NatsLink]:
    link = NatsLink(nats_url, "test-control")
    link.start()
    assert await link.wait_connected(10) and link.nc is not None
    await ensure_jetstream(link.nc.jetstream())
    try:
        yield link
    finally:
        await link.close()


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        assert await agent.link.wait_connected(10)
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def renew_lease(link: NatsLink) -> None:
    await link.kv_put(protocol.BUCKET_KEYS, api_keys.KEYS_LEASE, api_keys.KeyLease())


def on_disk(files: LocalState) -> Callable[[], tuple[set[str], int]]:
    def read() -> tuple[set[str], int]:
        desired = files.load_desired()
        return set(files.load_keys().keys), desired.generation if desired else -1

    return read


async def test_revocation_on_a_full_disk_applies_in_memory_is_reported_and_reaches_disk_later(
    tmp_path: Path, nats_server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = cluster_config(tmp_path, nats_server.url)
    disk = FullDisk(monkeypatch, config.state_dir)
    runtime = ScriptedRuntime()
    agent = Agent(config, runtime)
    files = agent.files
    async with control(nats_server.url) as cp, running(agent):
        await cp.kv_put(protocol.BUCKET_KEYS, "k-keep", record("k-keep"))
        await cp.kv_put(protocol.BUCKET_KEYS, "k-bad", record("k-bad"))
        await cp.kv_put(
            protocol.BUCKET_DESIRED, CLUSTER, DesiredState(cluster=CLUSTER, generation=1, replicas=[])
        )
        await renew_lease(cp)
        await eventually(lambda: on_disk(files)() == ({"k-keep", "k-bad"}, 1), timeout=10)
        await eventually(lambda: files.load_key_lease() is not None, timeout=10)

        disk.full = True
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            await cp.kv_delete(protocol.BUCKET_KEYS, "k-bad")  # the revocation
            await cp.kv_put(
                protocol.BUCKET_DESIRED,
                CLUSTER,
                DesiredState(cluster=CLUSTER, generation=2, replicas=[spec("r1")]),
            )
            # In memory at once, the disk notwithstanding: the replica starts, the key is gone.
            await eventually(lambda: "r1" in runtime.started, timeout=10)
            await eventually(lambda: "k-bad" not in agent.key_mirror.entries, timeout=10)
            await renew_lease(cp)
            await asyncio.sleep(1.5)  # renewals, retries and reconcile passes meet the full disk
            assert disk.refused > 0
            # the revocation is on disk (in place: it shrinks keys.json); the larger desired
            # state is not, yet
            assert on_disk(files)() == ({"k-keep"}, 1)
            heartbeat = agent.heartbeat()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

        disk.full = False  # space again: the retry writes what memory holds
        await eventually(lambda: on_disk(files)() == ({"k-keep"}, 2), timeout=10)
        await eventually(lambda: not files.writes.failing, timeout=10)

        # Loud, once per file and episode: the heartbeat names what is behind and counts
        # every failed write.
        assert heartbeat.state_writes_failing["desired.json"] == "ENOSPC"
        assert "keys.json" not in heartbeat.state_writes_failing  # current, if written in place
        assert heartbeat.state_write_failures >= 2
        assert agent.heartbeat().state_writes_failing == {}
        for name in ("keys.json", "desired.json"):
            once = [m for m in errors if m.startswith("cannot write") and name in m]
            assert len(once) == 1, errors


async def test_a_lease_renewal_is_not_recorded_while_only_keys_json_cannot_be_written(
    tmp_path: Path, nats_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keys.json cannot be written at all (the space left fits the small lease file, and
    a copy-on-write filesystem cannot overwrite in place): confirming the lease would make
    the gateway trust a keys.json that still holds the revoked key."""
    config = cluster_config(tmp_path, nats_server.url)
    disk = FullDisk(monkeypatch, config.state_dir)
    disk.names = {"keys.json"}
    monkeypatch.setattr(local_state, "overwrite_in_place", lambda path, data: False, raising=False)
    agent = Agent(config, ScriptedRuntime())
    files = agent.files
    async with control(nats_server.url) as cp, running(agent):
        await cp.kv_put(protocol.BUCKET_KEYS, "k-bad", record("k-bad"))
        await renew_lease(cp)
        await eventually(lambda: "k-bad" in files.load_keys().keys, timeout=10)
        await eventually(lambda: files.load_key_lease() is not None, timeout=10)
        lease_before = files.load_key_lease()

        disk.full = True
        await cp.kv_delete(protocol.BUCKET_KEYS, "k-bad")
        await eventually(lambda: "k-bad" not in agent.key_mirror.entries, timeout=10)
        await renew_lease(cp)
        await asyncio.sleep(1.0)
        assert files.load_key_lease() == lease_before
        assert "k-bad" in files.load_keys().keys

        disk.full = False
        await eventually(lambda: "k-bad" not in files.load_keys().keys, timeout=10)
