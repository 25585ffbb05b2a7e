"""Usage across a change of leader: the old leader committed a batch but died before its
acks, so JetStream redelivers the same messages (same stream sequences) to the new
leader's durable consumer; every record is in the database once, one without a record id
too (stored under its stream sequence), and the tokens are counted once. The tokens refused
within the quota-share window, which the old leader held in memory, are read back from the
stream, each once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from sqlalchemy import func, select

from control_plane.counters import Rejections
from control_plane.db import models as m
from control_plane.loops.durable import Received
from control_plane.loops.usage import UsageLoop, store_usage_batch
from control_plane.settings import Settings
from fleet_base import protocol
from tests.control_plane.rollouts.test_resume import _Stream
from tests.control_plane.test_report_scope import _fleet


def _batch() -> list[Received]:
    records = [
        protocol.UsageRecord(cluster="east", key_id="k1", deployment="chat", version=1, prompt_tokens=10 + i)
        for i in range(5)
    ]
    records.append(
        protocol.UsageRecord(
            cluster="east", key_id="k1", deployment="chat", version=1, prompt_tokens=100, record_id=None
        )
    )
    return [Received(protocol.usage_subject("east"), r.to_bytes(), seq) for seq, r in enumerate(records, 1)]


def test_a_batch_redelivered_to_the_new_leader_is_stored_once(sessions) -> None:
    _fleet(sessions)
    batch = _batch()
    store_usage_batch(sessions, batch, Rejections())  # the old leader: committed, never acked
    store_usage_batch(sessions, batch[2:], Rejections())  # the new leader: a partial redelivery
    store_usage_batch(sessions, batch, Rejections())  # and the whole of it
    with sessions() as s:
        rows = s.scalar(select(func.count()).select_from(m.UsageRecord))
        tokens = s.scalar(select(func.sum(m.UsageRecord.prompt_tokens)))
    assert rows == 6 and tokens == sum(10 + i for i in range(5)) + 100


class _Link:
    def __init__(self, js) -> None:
        self.js = js

    async def wait_connected(self, timeout: float | None = None) -> bool:
        return True


def test_a_new_leader_reads_back_the_tokens_refused_within_the_share_window(sessions, tmp_path) -> None:
    _fleet(sessions)
    now = time.time()

    def refusal(tokens: int, age_s: float) -> protocol.UsageRecord:
        return protocol.UsageRecord(
            cluster="west", key_id="k1", deployment="chat", status=429, refused_tokens=tokens, at=now - age_s
        )

    recent = [refusal(500, 10), refusal(300, 40)]
    stream = [
        refusal(9000, 200),  # before the window: no longer demand
        *recent,
        protocol.UsageRecord(cluster="east", key_id="k1", deployment="chat", version=1, prompt_tokens=50, at=now - 5),
    ]  # fmt: skip
    settings = Settings(home=tmp_path)
    loop = UsageLoop(SimpleNamespace(nats=_Link(_Stream(stream)), sessions=sessions, settings=settings))
    asyncio.run(loop._replay_refused())
    assert loop.refusals_replayed == 2
    assert loop.refused() == {"k1": {"west": 800.0}}
    # the old leader never acknowledged the last one: the durable consumer delivers it too
    redelivered = [Received(protocol.usage_subject("west"), recent[0].to_bytes(), 2)]
    store_usage_batch(sessions, redelivered, Rejections(), loop._on_refused)
    assert loop.refused() == {"k1": {"west": 800.0}}
    with sessions() as s:  # a refusal is demand, not usage: nothing stored
        assert s.scalar(select(func.count()).select_from(m.UsageRecord)) == 0
