"""Usage across a change of leader: the old leader committed a batch but died before its
acks, so JetStream redelivers the same messages (same stream sequences) to the new
leader's durable consumer; every record is in the database once, one without a record id
too (stored under its stream sequence), and the tokens are counted once."""

from __future__ import annotations

from sqlalchemy import func, select

from control_plane.counters import Rejections
from control_plane.db import models as m
from control_plane.loops.durable import Received
from control_plane.loops.usage import store_usage_batch
from fleet_base import protocol
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
