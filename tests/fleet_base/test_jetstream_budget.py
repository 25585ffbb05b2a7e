"""The JetStream budget: the shares fit the store with headroom, the usage stream keeps
the largest, every resource of the wire contract has one, and each stream's limits are
ones nats-server accepts at the smallest store."""

from __future__ import annotations

import pytest

from fleet_base import protocol
from fleet_base.batch import names as batch
from fleet_base.batch.resources import KV_BUCKETS, QUEUES
from fleet_base.jetstream_budget import MIN_STORE_BYTES, SHARES, JetStreamBudget

HEADROOM = 0.10  # consumer state and metadata


def test_shares_leave_headroom_and_usage_keeps_the_largest() -> None:
    assert sum(SHARES.values()) <= 1 - HEADROOM + 1e-9
    assert max(SHARES, key=SHARES.get) == protocol.STREAM_USAGE


def test_every_stream_and_bucket_has_a_share() -> None:
    wanted = {f"KV_{b}" for b in (*protocol.BUCKETS, *KV_BUCKETS)}
    wanted |= {protocol.STREAM_EVENTS, protocol.STREAM_USAGE, f"OBJ_{batch.OBJECT_BUCKET_FILES}"}
    wanted |= {stream for stream, _ in QUEUES}
    assert wanted == set(SHARES)


@pytest.mark.parametrize("store_bytes", [MIN_STORE_BYTES, 2 << 30, 1 << 40])
def test_limits_fit_the_store(store_bytes: int) -> None:
    budget = JetStreamBudget(store_bytes=store_bytes)
    assert budget.reserved_bytes <= store_bytes
    for stream in SHARES:
        limits = budget.limits(stream)
        assert 0 < limits.max_bytes
        assert limits.max_msg_size == -1 or 0 < limits.max_msg_size <= limits.max_bytes
