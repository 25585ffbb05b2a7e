"""A restarted control plane replays the usage of open rollout windows from the
FLEET_USAGE stream (real nats-server), so a resumed step is judged on its whole window:
records from before the window are left out, and live records keep arriving. Records from
a cluster that hosts no replica of the canary are left out, replayed or live."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from control_plane.db import models as m
from control_plane.local.nats_server import NatsServer
from control_plane.rollouts.loop import RolloutLoop
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import STREAM_USAGE, UsageRecord, usage_subject
from tests.polling import eventually


@pytest.fixture
def nats_url(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server.url
    finally:
        server.stop()


def record(version: int, status: int, at: float, cluster: str = "c1") -> UsageRecord:
    return UsageRecord(
        cluster=cluster, key_id="k", deployment="web", version=version, status=status, latency_s=0.1, at=at
    )


async def test_open_windows_are_replayed_from_the_stream(sessions, nats_url):
    now = time.time()
    window = now - 30
    with sessions() as s:
        d = m.Deployment(name="web", replicas=2, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="a"), m.DeploymentVersion(version=2, model="b")]
        s.add_all([d, m.Cluster(id="c1", load={}), m.Cluster(id="c2", load={})])
        s.flush()
        # the canary runs on c1 only: what c2 says about v2 is not counted
        s.add(
            m.ReplicaAssignment(
                replica_id="r2", deployment_id=d.id, version=2, cluster_id="c1", state="ready"
            )
        )
        s.add(
            m.Rollout(
                deployment_id=d.id, baseline_version=1, canary_version=2, phase="observing", step=0,
                params={"steps": [50, 100], "min_requests": 5}, phase_started_at=window,
                window_started_at=window, reason="", last={}, revision=0,
            )
        )  # fmt: skip
        s.commit()
    publisher = NatsLink(nats_url, "test-gateway")
    publisher.start()
    assert await publisher.wait_connected(10)
    for i in range(6):
        assert await publisher.publish(usage_subject("c1"), record(2, 500 if i < 2 else 200, window + 1 + i))
    assert await publisher.publish(usage_subject("c1"), record(2, 500, window - 5))  # before the window
    for i in range(5):  # a cluster without the canary cannot force its rollback
        assert await publisher.publish(usage_subject("c2"), record(2, 500, window + 2 + i, cluster="c2"))
    js = publisher.nc.jetstream()

    async def stored() -> bool:
        return (await js.stream_info(STREAM_USAGE)).state.messages >= 12

    await eventually(stored, 15, "the usage records stored in the stream")

    link = NatsLink(nats_url, "test-cp")
    loop = RolloutLoop(SimpleNamespace(sessions=sessions, nats=link, kick=lambda: None))
    link.on_connect(loop._on_connect)
    link.start()
    try:
        assert await link.wait_connected(10)
        await eventually(lambda: loop.replayed is not None, 15, "the replay")
        assert loop.replayed == 6
        stats = loop.windows.stats("web", 2, window)
        assert (stats.requests, stats.errors) == (6, 2)
        # a live record after the replay is counted once
        assert await publisher.publish(usage_subject("c2"), record(2, 500, time.time(), cluster="c2"))
        assert await publisher.publish(usage_subject("c1"), record(2, 200, time.time()))
        await eventually(lambda: loop.windows.stats("web", 2, window).requests >= 7, 15, "the live record")
        assert loop.windows.stats("web", 2, window).requests == 7
        assert loop.rejections.refusals[("rollout_sample", "not_hosted")] == 6
        # the decision uses the whole window: 2 errors of 7 > 2% -> rolled back
        assert await asyncio.to_thread(loop.tick, time.time()) is True
        with sessions() as s:
            assert s.query(m.Rollout).one().phase == "rolled_back"
    finally:
        await loop.stop()
        await link.close()
        await publisher.close()
