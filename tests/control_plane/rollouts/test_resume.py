"""A rollout continues at its step with its guard window after a change of leader: the new
leader replays the window's usage from the stream and passes the step when, and on the
numbers with which, the old leader would have; without the replay it restarts the step's
window where its own evidence begins and never passes the step on less (Knative-style
table: usage records and ticks on a fake clock, the stream a fake JetStream)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace

import nats.errors
import pytest
from sqlalchemy import select

from control_plane.db import models as m
from control_plane.db.session import make_sessions
from control_plane.rollouts.loop import RolloutLoop
from control_plane.rollouts.telemetry import UsageWindows
from fleet_base.protocol import UsageRecord, usage_subject
from tests.control_plane.conftest import copy_sqlite

T0 = float(int(time.time()) - 3600)  # the step's window opened here (whole seconds: exact timestamps)
STEP_S = 60.0
MIN_REQUESTS = 50


@dataclass
class _Msg:
    subject: str
    data: bytes
    metadata: SimpleNamespace


class _Sub:
    def __init__(self, msgs: list[_Msg]) -> None:
        self.msgs = msgs

    async def next_msg(self, timeout: float) -> _Msg:
        if not self.msgs:
            raise nats.errors.TimeoutError
        return self.msgs.pop(0)

    async def unsubscribe(self) -> None:
        pass


class _Stream:
    """FLEET_USAGE as a JetStream ordered consumer from a start time sees it; `dropped`:
    the oldest messages the stream discarded (it discards the oldest when full)."""

    def __init__(self, records: list[UsageRecord], dropped: int = 0) -> None:
        self.records, self.dropped = records, dropped

    async def stream_info(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(first_seq=self.dropped + 1))

    async def subscribe(self, subject, stream, ordered_consumer, config) -> _Sub:
        start = datetime.fromisoformat(config.opt_start_time.replace("Z", "+00:00")).timestamp()
        kept = list(enumerate(self.records, start=1))[self.dropped :]
        chosen = [(seq, r) for seq, r in kept if r.at >= start]
        return _Sub(
            [
                _Msg(
                    usage_subject(r.cluster),
                    r.to_bytes(),
                    SimpleNamespace(
                        num_pending=len(chosen) - i - 1,
                        sequence=SimpleNamespace(stream=seq),
                        timestamp=datetime.fromtimestamp(r.at, timezone.utc),
                    ),
                )
                for i, (seq, r) in enumerate(chosen)
            ]
        )


def _database(migrated_sqlite, tmp_path, name: str):
    """A fleet with one rollout observing step 1 of 2 since T0 (the canary on c1)."""
    path = tmp_path / name
    copy_sqlite(migrated_sqlite, path)
    sessions = make_sessions(f"sqlite:///{path}")
    with sessions() as s:
        d = m.Deployment(name="web", replicas=2, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="a"), m.DeploymentVersion(version=2, model="b")]
        s.add_all([d, m.Cluster(id="c1", load={})])
        s.flush()
        s.add_all(
            m.ReplicaAssignment(replica_id=f"r{v}", deployment_id=d.id, version=v, cluster_id="c1", state="ready")
            for v in (1, 2)
        )  # fmt: skip
        s.add(
            m.Rollout(
                deployment_id=d.id, baseline_version=1, canary_version=2, phase="observing", step=0,
                params={"steps": [50, 100], "min_requests": MIN_REQUESTS, "step_duration_s": STEP_S},
                phase_started_at=T0, window_started_at=T0, reason="", last={}, revision=0,
            )
        )  # fmt: skip
        s.commit()
    return sessions


RECORDS = [
    UsageRecord(
        cluster="c1",
        key_id="k",
        deployment="web",
        version=version,
        status=500 if version == 2 and i % 60 == 0 else 200,
        latency_s=0.1 + 0.001 * (i % 7),
        at=T0 + i,
    )
    for i in range(1, 200)
    for version in (1, 2)
]  # a canary and a baseline request each second; every 60th canary request fails (within 2 %)


def _loop(sessions, started_at: float, nats=None) -> RolloutLoop:
    loop = RolloutLoop(
        SimpleNamespace(sessions=sessions, nats=nats, kick=lambda: None),
        windows=UsageWindows(clock=lambda: 0.0),
    )
    loop.started_at = started_at
    loop.hosting = loop._read_hosting()
    return loop


def _run(loop: RolloutLoop, ticks: range, since: float = 0.0) -> list[tuple[float, str, dict]]:
    """The records of each second as they arrive (the live subscription, from `since`), a
    tick every second; the decisions that changed the rollout, with their numbers."""
    out, seen = [], min(since, T0 + ticks.start - 1)
    for t in ticks:
        for r in RECORDS:
            if seen < r.at <= T0 + t and r.at >= since:
                loop.windows.add(r, at=r.at)
        seen = T0 + t
        before = loop.decisions
        loop.tick(T0 + t)
        if loop.decisions > before:
            with loop.ctx.sessions() as s:
                row = s.scalar(select(m.Rollout))
                out.append((T0 + t, row.phase, {k: v for k, v in row.last.items() if k != "status"}))
    return out


def _stored_window(sessions) -> float | None:
    with sessions() as s:
        return s.scalar(select(m.Rollout.window_started_at))


def test_the_new_leader_passes_the_step_when_and_as_the_old_one_would(migrated_sqlite, tmp_path) -> None:
    whole = _database(migrated_sqlite, tmp_path, "whole.db")
    expected = _run(_loop(whole, started_at=T0 - 100), range(1, 90))
    assert expected[0][0] == T0 + STEP_S and expected[0][1] == "deploying"  # step 1 passed at 60 s
    assert expected[0][2]["canary_requests"] == STEP_S and expected[0][2]["canary_errors"] == 1

    # The same rollout; its leader dies at 30 s, a new one takes over at 40 s: it replays
    # the window from the stream, and the live feed (its subscription began at 38 s) overlaps.
    shared = _database(migrated_sqlite, tmp_path, "shared.db")
    got = _run(_loop(shared, started_at=T0 - 100), range(1, 31))
    stream = SimpleNamespace(js=_Stream(RECORDS))
    new = _loop(shared, started_at=T0 + 40, nats=stream)
    assert asyncio.run(new._replay(until=T0 + 40)) == 2 * 39
    got += _run(new, range(41, 90), since=T0 + 38)
    assert new.windows.duplicates > 0  # records came both ways and were counted once
    assert got == expected
    assert _stored_window(shared) == T0  # the step's window as the old leader opened it


def test_without_the_replay_the_step_window_restarts_where_the_evidence_begins(
    migrated_sqlite, tmp_path
) -> None:
    shared = _database(migrated_sqlite, tmp_path, "norelay.db")
    _run(_loop(shared, started_at=T0 - 100), range(1, 31))
    new = _loop(shared, started_at=T0 + 40)  # NATS was not there at its start: nothing replayed
    got = _run(new, range(41, 110), since=T0 + 40)
    # the step passed a whole window after the new leader's evidence began, on a whole window
    assert got[0][0] == T0 + 40 + STEP_S and got[0][1] == "deploying"
    assert _stored_window(shared) == T0 + 40  # restarted where the new leader's evidence began
    assert got[0][2]["canary_requests"] >= STEP_S - 1


def test_a_window_older_than_what_the_stream_still_holds_restarts_where_it_begins(
    migrated_sqlite, tmp_path
) -> None:
    shared = _database(migrated_sqlite, tmp_path, "dropped.db")
    _run(_loop(shared, started_at=T0 - 100), range(1, 31))
    # the stream discarded its oldest messages: what it holds of the window begins at 20 s
    stream = SimpleNamespace(js=_Stream(RECORDS, dropped=2 * 19))
    new = _loop(shared, started_at=T0 + 40, nats=stream)
    assert asyncio.run(new._replay(until=T0 + 40)) == 2 * 20
    assert new.replayed_since == pytest.approx(T0 + 20, abs=1e-3)  # (the timestamp's microseconds)
    got = _run(new, range(41, 110), since=T0 + 38)
    assert got[0][0] == T0 + 20 + STEP_S and got[0][1] == "deploying"
    assert _stored_window(shared) == pytest.approx(T0 + 20, abs=1e-3)
