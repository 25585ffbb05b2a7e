"""The prefix index keeps each block's tiers per replica: a block may be on the device and
in the host tier of the same replica, a removal takes only its tier's copy, and events
without a tier (every engine before the host tier) are device events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gateway.kv_index import KvUpdate, PrefixIndex, block_key
from agent.gateway.prefix import to_update
from agent.kv_relay import CHUNK, _chunks
from fleet_base.kv_events import KvCacheBatch, KvCacheOp

KEYS = st.integers(min_value=0, max_value=20)
TIER = st.sampled_from(["device", "host"])
OP = st.one_of(
    st.tuples(st.sampled_from(["stored", "removed"]), st.lists(KEYS, max_size=6), TIER),
    st.tuples(st.sampled_from(["stored", "removed"]), st.lists(KEYS, max_size=6)),  # no tier: device
    st.just(("cleared", [])),
)


def _apply(index: PrefixIndex, seq: int, ops, *, snapshot: bool = False) -> str:
    wire = tuple((kind, tuple(keys), *rest) for kind, keys, *rest in ops)
    return index.apply(KvUpdate("c", "r1", "d", "e1", seq, wire, snapshot=snapshot))


def _model(truth: dict[int, set[str]], ops) -> None:
    for kind, keys, *rest in ops:
        tier = rest[0] if rest else "device"
        if kind == "cleared":
            truth.clear()
        for k in keys:
            if kind == "stored":
                truth.setdefault(k, set()).add(tier)
            elif kind == "removed" and k in truth:
                truth[k].discard(tier)
                if not truth[k]:
                    del truth[k]


def _reference_match(truth: dict[int, set[str]], hashes: list[int]) -> tuple[int, int]:
    """The engine's lookup: the device prefix, then the host tier where it ends."""
    device = 0
    while device < len(hashes) and "device" in truth.get(hashes[device], ()):
        device += 1
    host = device
    while host < len(hashes) and "host" in truth.get(hashes[host], ()):
        host += 1
    return device, host - device


@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(OP, min_size=1, max_size=5), max_size=25), st.lists(KEYS, max_size=10))
def test_the_index_holds_exactly_each_blocks_tiers(batches, prompt) -> None:
    """Unbounded, the index is the replica's truth per (block, tier): a removal takes one
    tier's copy and keeps the other; counts per tier are never negative and match."""
    index = PrefixIndex()
    _apply(index, 0, [], snapshot=True)
    truth: dict[int, set[str]] = {}
    for seq, ops in enumerate(batches, start=1):
        assert _apply(index, seq, ops) == "applied"
        _model(truth, ops)
        for k in range(21):
            for tier in ("device", "host"):
                assert index.holds("c", "r1", k, tier) == (tier in truth.get(k, ())), (k, tier)
            assert index.holds("c", "r1", k) == (k in truth)
        counts = index.tier_blocks("c", "r1")
        assert min(counts.values()) >= 0
        assert counts == {t: sum(1 for tiers in truth.values() if t in tiers) for t in ("device", "host")}
        assert index.size == len(truth)
        assert index.match_tiers("c", "r1", prompt) == _reference_match(truth, prompt)
        assert index.match("c", "r1", prompt) == sum(_reference_match(truth, prompt))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(OP, min_size=1, max_size=5), max_size=25), st.integers(1, 8), st.integers(1, 8))
def test_bounded_the_index_claims_nothing_the_replica_lacks(batches, cap, cluster_cap) -> None:
    """Bounds (per replica, per cluster) forget blocks, never invent a tier; the per-tier
    counts stay those of the blocks held."""
    index = PrefixIndex(max_blocks_per_replica=cap, max_blocks_per_cluster=cluster_cap)
    _apply(index, 0, [], snapshot=True)
    truth: dict[int, set[str]] = {}
    for seq, ops in enumerate(batches, start=1):
        _apply(index, seq, ops)
        _model(truth, ops)
        for k in range(21):
            for tier in ("device", "host"):
                if index.holds("c", "r1", k, tier):
                    assert tier in truth.get(k, ())
        counts = index.tier_blocks("c", "r1")
        assert index.size <= min(cap, cluster_cap) and min(counts.values()) >= 0
        for tier in ("device", "host"):
            assert counts[tier] == sum(index.holds("c", "r1", k, tier) for k in range(21))


def test_an_offload_keeps_the_host_copy_and_a_load_back_the_device_copy() -> None:
    index = PrefixIndex()
    _apply(index, 0, [("stored", [1, 2, 3])], snapshot=True)
    assert index.match_tiers("c", "r1", [1, 2, 3]) == (3, 0)
    # offload of 2 and 3: the host copy stored, then the device copy removed
    _apply(index, 1, [("stored", [2, 3], "host"), ("removed", [2, 3], "device")])
    assert index.match_tiers("c", "r1", [1, 2, 3]) == (1, 2)
    assert index.holds("c", "r1", 2, "host") and not index.holds("c", "r1", 2, "device")
    # loaded back: on both tiers; a host eviction leaves the device copy
    _apply(index, 2, [("stored", [2], "device"), ("removed", [2], "host")])
    assert index.match_tiers("c", "r1", [1, 2, 3]) == (2, 1)
    # the host evicts 3: the prefix ends at 2
    _apply(index, 3, [("removed", [3], "host")])
    assert index.match_tiers("c", "r1", [1, 2, 3]) == (2, 0) and not index.holds("c", "r1", 3)
    # a device block after the host run is not reached (the lookup ends with the host's run)
    _apply(index, 4, [("stored", [3], "device"), ("removed", [1], "device"), ("stored", [1], "host")])
    assert index.match_tiers("c", "r1", [1, 2, 3]) == (0, 1)
    _apply(index, 5, [("cleared", [])])
    assert index.size == 0 and index.tier_blocks("c", "r1") == {"device": 0, "host": 0}


def test_old_payloads_are_device_events_and_device_ops_go_out_as_before() -> None:
    h = "ab" * 32
    old = (
        b'{"schema_version":1,"cluster":"c","deployment":"d","replica_id":"r1","epoch":"e","seq":0,'
        b'"snapshot":true,"block_size":16,"ops":[{"kind":"stored","block_hashes":["' + h.encode() + b'"]}]}'
    )
    batch = KvCacheBatch.from_bytes(old)
    assert batch.ops[0].tier == "device"
    assert b"tier" not in batch.to_bytes()  # a reader that predates tiers reads it too
    index = PrefixIndex()
    assert index.apply(to_update(batch)) == "applied"
    key = block_key(bytes.fromhex(h))
    assert index.holds("c", "r1", key, "device") and not index.holds("c", "r1", key, "host")
    host = batch.model_copy(
        update={"seq": 1, "snapshot": False, "ops": [KvCacheOp(kind="stored", block_hashes=[h], tier="host")]}
    )
    wire = KvCacheBatch.from_bytes(host.to_bytes())
    assert wire.ops[0].tier == "host" and b'"tier":"host"' in host.to_bytes()
    assert index.apply(to_update(wire)) == "applied"
    assert index.holds("c", "r1", key, "device") and index.holds("c", "r1", key, "host")
    removed = KvCacheOp(kind="removed", block_hashes=[h])
    assert index.apply(to_update(host.model_copy(update={"seq": 2, "ops": [removed]}))) == "applied"
    assert index.match_tiers("c", "r1", [key]) == (0, 1)


def test_the_relay_keeps_each_ops_tier_across_chunks() -> None:
    hashes = [f"{i:064x}" for i in range(CHUNK + 10)]
    engine_ops = [("stored", hashes, "device"), ("stored", hashes[:20], "host"), ("removed", hashes[:5])]
    ops = [op for chunk in _chunks(engine_ops) for op in chunk]
    assert [(op.kind, op.tier, len(op.block_hashes)) for op in ops] == [
        ("stored", "device", CHUNK),
        ("stored", "device", 10),
        ("stored", "host", 20),
        ("removed", "device", 5),  # an engine op without a tier is a device op
    ]
