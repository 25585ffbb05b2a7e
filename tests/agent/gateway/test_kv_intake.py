"""A gateway's intake of KV events: dropped unparsed past a cluster's budget or the size
cap, counted by reason; and the relay's batches fit what readers accept."""

from __future__ import annotations

from types import SimpleNamespace

from agent.gateway.metrics import GatewayMetrics
from agent.gateway.prefix import PrefixRouting
from agent.kv_relay import CHUNK, Followed, KvRelay, _chunks
from fleet_base.kv_events import (
    ALL_REPLICAS,
    MAX_BATCH_BYTES,
    MAX_BATCH_OPS,
    KvCacheBatch,
    KvResyncRequest,
    kvcache_subject,
    kvresync_subject,
)
from fleet_base.nats_io import NatsLink
from tests.agent.gateway.test_units import Clock


def test_intake_drops_before_parsing_and_counts_why() -> None:
    clock = Clock()
    prefix = PrefixRouting(None, "east", GatewayMetrics(load=dict), events_per_s=1, clock=clock)
    prefix.intake.budget.burst_s = 1.0
    good = KvCacheBatch(cluster="west", deployment="d", replica_id="r", epoch="e", seq=0).to_bytes()
    subject = kvcache_subject("west")
    assert prefix.admit(subject, b"{" * (MAX_BATCH_BYTES + 1)) is None  # not JSON: never parsed
    assert prefix.admit("fleet.v1.kvcache.Not_A_Cluster", good) is None
    assert prefix.admit(kvcache_subject("south"), good) is None  # west's batch on south's subject
    assert prefix.admit(subject, good) is not None
    assert prefix.admit(subject, good) is None  # one a second
    assert prefix.admit(subject, b"{}") is None
    dropped = {labels[0]: c._value.get() for labels, c in prefix.dropped._metrics.items()}
    assert dropped == {"size": 1, "sender": 1, "subject": 1, "rate": 2}
    clock.t = 5.0
    assert prefix.admit(subject, b"{}") is None
    assert prefix.dropped.labels("malformed")._value.get() == 1


def test_the_relay_splits_a_big_snapshot_into_batches_readers_accept() -> None:
    hashes = [f"{i:064x}" for i in range(3 * CHUNK + 5)]
    chunks = _chunks([("stored", hashes)] + [("removed", [h]) for h in hashes[:600]] + [("cleared", [])])
    assert [h for c in chunks for op in c for h in op.block_hashes if op.kind == "stored"] == hashes
    for i, chunk in enumerate(chunks):
        batch = KvCacheBatch(cluster="c", deployment="d", replica_id="r", epoch="e", seq=i, ops=chunk)
        assert len(chunk) <= MAX_BATCH_OPS and len(batch.to_bytes()) <= MAX_BATCH_BYTES
        KvCacheBatch.model_validate_json(batch.to_bytes())
    assert chunks[-1][-1].kind == "cleared"


async def test_the_relay_drops_a_flood_of_resync_requests_unparsed() -> None:
    relay = KvRelay(NatsLink("nats://127.0.0.1:1", "agent"), "east")
    relay.sync([Followed("r1", "d", "http://127.0.0.1:1")])
    subject = kvresync_subject("east")
    ask = KvResyncRequest(cluster="east", replica_id=ALL_REPLICAS, requester="west").to_bytes()
    try:
        await relay._on_resync(SimpleNamespace(subject=subject, data=b" " * 2048))
        assert relay.resync_dropped == 1 and not relay._resync
        await relay._on_resync(SimpleNamespace(subject=subject, data=ask))
        assert relay._resync == {"r1"}
        for _ in range(1000):
            await relay._on_resync(SimpleNamespace(subject=subject, data=ask))
        assert relay.resync_dropped >= 1000 - 8 * 100
    finally:
        await relay.close()
