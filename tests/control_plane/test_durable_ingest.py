"""Durable ingestion against a real nats-server and a real control plane process: usage and
events published while the control plane is down, or while it dies between receiving a batch
and committing it (or between the commit and the acks), are all in the database once.

Two publishers play the gateways of two clusters (the records are what a gateway sends).
On PostgreSQL when one is configured (CI), else SQLite: tests/e2e/test_control_plane_outage_usage.py
runs the whole fleet (SQLite, the default) through a control plane outage."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time

import pytest
import sqlalchemy as sa

from control_plane.db import models as m
from control_plane.db import session as dbs
from control_plane.local.nats_server import NatsServer
from fleet_base import protocol
from fleet_base.nats_io import NatsLink
from tests.control_plane.cp_server import PG_ENV, SHORT_LEASE_ENV, ControlPlaneServer, fresh_database
from tests.polling import wait_for

pytestmark = pytest.mark.slow

CLUSTERS = ("east", "west")
DOWN_S = float(os.environ.get("FLEET_TEST_DOWN_S", "3"))


def _rows(url: str) -> tuple[int, int, int, int]:
    engine = dbs.make_engine(url)
    try:
        with engine.connect() as conn:
            n, tokens, ids = conn.execute(
                sa.text(
                    "SELECT count(*), coalesce(sum(prompt_tokens + completion_tokens), 0), "
                    "count(DISTINCT record_id) FROM usage_records"
                )
            ).one()
            events = conn.execute(sa.text("SELECT count(*) FROM events WHERE kind = 'info'")).scalar_one()
            return int(n), int(tokens), int(ids), int(events)
    finally:
        engine.dispose()


class Traffic:
    """What the two "gateways" sent: usage records and agent events, with their tokens."""

    def __init__(self, link: NatsLink) -> None:
        self.link = link
        self.records = 0
        self.tokens = 0
        self.events = 0

    async def send(self, n: int) -> None:
        for i in range(n):
            cluster = CLUSTERS[i % 2]
            record = protocol.UsageRecord(
                cluster=cluster, key_id="k1", deployment="d", prompt_tokens=7 + i % 5, completion_tokens=11
            )
            assert await self.link.publish(protocol.usage_subject(cluster), record)
            self.records += 1
            self.tokens += record.prompt_tokens + record.completion_tokens
            if i % 10 == 0:
                event = protocol.Event(cluster=cluster, kind="info", message=f"event {i}")
                assert await self.link.publish(protocol.events_subject(cluster), event)
                self.events += 1
        await self.link.nc.flush()
        # poison in the same streams: skipped, never blocking the rest
        await self.link.nc.publish(protocol.usage_subject("east"), b'{"cluster": "east", "key_id": ')
        await self.link.nc.publish(
            protocol.events_subject("east"), b'{"cluster": "east", "kind": "info", "at": 1e300}'
        )
        # well-formed, but beyond the sender: a key that does not exist, a date never pruned
        for record in (
            protocol.UsageRecord(cluster="west", key_id="nokey", deployment="d", prompt_tokens=999),
            protocol.UsageRecord(cluster="east", key_id="k1", deployment="d", prompt_tokens=999, at=2.5e11),
        ):
            assert await self.link.publish(protocol.usage_subject(record.cluster), record)
        await self.link.nc.flush()


def _wait_rows(url: str, traffic: Traffic, timeout: float = 60.0) -> tuple[int, int, int, int]:
    """The row counts once every usage record and event sent so far is in (callers check them exactly)."""

    def arrived() -> tuple[int, int, int, int] | None:
        got = _rows(url)
        return got if got[0] >= traffic.records and got[3] >= traffic.events else None

    what = f"{traffic.records} usage rows and {traffic.events} events"
    return wait_for(arrived, timeout, what, 0.2)


def _seed(url: str) -> None:
    """The key and deployment the records name, placed on both clusters (a `placed` event
    the control plane wrote: usage is counted only where its deployment was placed)."""
    dbs.upgrade_to_head(url)
    sessions = dbs.make_sessions(url)
    try:
        with sessions() as s:
            s.add_all([m.Cluster(id=c, region=c, load={}) for c in CLUSTERS])
            s.add(m.ApiKey(key_id="k1", name="k1", salt="s", hash="h"))
            d = m.Deployment(name="d", replicas=0, current_version=1)
            d.versions = [m.DeploymentVersion(version=1, model="m", min_replicas=0, max_replicas=0)]
            s.add(d)
            s.add_all([m.Event(kind="placed", cluster=c, deployment="d", message="seed") for c in CLUSTERS])
            s.commit()
    finally:
        sessions.kw["bind"].dispose()


@pytest.fixture
def db_url(tmp_path):
    url, cleanup = fresh_database("postgresql" if os.environ.get(PG_ENV) else "sqlite", tmp_path)
    _seed(url)
    yield url
    cleanup()


async def test_nothing_lost_nothing_counted_twice(db_url: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLEET_INGEST_ACK_WAIT_S", "2")
    for name, value in SHORT_LEASE_ENV.items():  # each instance killed here held the lease
        monkeypatch.setenv(name, value)
    nats = NatsServer(tmp_path / "nats").start()
    link = NatsLink(nats.url, "test-gateways")
    link.start()
    try:
        assert await link.wait_connected(15)
        traffic = Traffic(link)
        await traffic.send(40)  # before the control plane ever ran

        # Dies right after receiving its first batch: nothing was committed.
        crashing = ControlPlaneServer(tmp_path / "home", db_url, nats.url, loops=True)
        crashing_env = {"FLEET_TEST_INGEST_CRASH": "received"}
        await asyncio.to_thread(_start_until_exit, crashing, crashing_env)
        assert _rows(db_url) == (0, 0, 0, 0)

        # Dies right after committing, before any ack: everything is redelivered later.
        await asyncio.to_thread(_start_until_exit, crashing, {"FLEET_TEST_INGEST_CRASH": "committed"})
        committed = _rows(db_url)
        assert committed[0] + committed[3] > 0  # a usage or an events batch, never acknowledged

        cp = ControlPlaneServer(tmp_path / "home", db_url, nats.url, loops=True)
        await asyncio.to_thread(cp.start)
        try:
            await traffic.send(30)
            got = await asyncio.to_thread(_wait_rows, db_url, traffic)
            assert got == (traffic.records, traffic.tokens, traffic.records, traffic.events)

            cp.stop()  # down, under traffic
            deadline = time.monotonic() + DOWN_S
            while time.monotonic() < deadline:
                await traffic.send(20)
                await asyncio.sleep(0.5)
            await asyncio.to_thread(cp.start)
            got = await asyncio.to_thread(_wait_rows, db_url, traffic)
            assert got == (traffic.records, traffic.tokens, traffic.records, traffic.events)
            with cp.client() as admin:
                text = admin.get("/metrics").text
            assert (
                'fleet_control_plane_rejected_messages_total{reason="malformed",subject="fleet.v1.usage.*"}'
                in text
            )
            assert (
                'fleet_control_plane_rejected_messages_total{reason="malformed",subject="fleet.v1.events.*"}'
                in text
            )
            for reason in ("unknown_key", "future"):
                line = f'fleet_control_plane_reports_refused_total{{kind="usage",reason="{reason}"}}'
                assert any(row.startswith(line) and float(row.split()[-1]) > 0 for row in text.splitlines())
        finally:
            cp.stop()
    finally:
        await link.close()
        nats.stop()


def _start_until_exit(server: ControlPlaneServer, extra_env: dict[str, str], timeout: float = 60.0) -> None:
    """Start with `extra_env` and wait for the process to die at its crash point."""
    os.environ.update(extra_env)
    try:
        try:
            server.start(timeout=timeout)
        except RuntimeError as err:  # it may die before it answered /healthz
            assert "exited with 137" in str(err), err
            return
        assert server.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout)  # a process that outlives it fails the assertion below, with its log
        assert server.proc.returncode == 137, server.log_tail()
        server.proc = None
    finally:
        for k in extra_env:
            os.environ.pop(k, None)
