"""The prefix index: property tests (never claims an evicted block, bounded memory,
gaps drop a replica until its full set comes) and the gateway's block keys against the
engine's own prefix cache, salt included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gateway.kv_index import KvUpdate, PrefixIndex, block_key
from agent.gateway.prefix import prefix_keys, to_update
from engine.kv_cache import KVCacheManager
from engine.request import Request
from fleet_base.kv_events import KvCacheBatch, KvCacheOp
from fleet_base.sampling_params import SamplingParams

KEYS = st.integers(min_value=0, max_value=40)
OP = st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.lists(KEYS, max_size=8))
# A stream of batches as a replica sends them; each may be lost, duplicated or reordered.
STREAM = st.lists(
    st.tuples(st.lists(OP, min_size=1, max_size=4), st.sampled_from(["ok", "lost", "dup", "swap"])),
    max_size=30,
)


def _update(seq: int, ops, *, snapshot: bool = False, rid: str = "r1", epoch: str = "e1") -> KvUpdate:
    return KvUpdate("c", rid, "d", epoch, seq, tuple((k, tuple(v)) for k, v in ops), snapshot=snapshot)


@settings(max_examples=80, deadline=None)
@given(STREAM, st.integers(min_value=1, max_value=12))
def test_never_claims_a_block_evicted_after_the_eviction_arrived(stream, cap) -> None:
    """Whatever the network does to the batches, a block the index claims is one the
    replica holds: every claim is backed by the replica's true set at the last
    consecutive batch applied, and no block removed by an applied batch is claimed."""
    index = PrefixIndex(max_blocks_per_replica=cap)
    truth: set[int] = set()
    truth_at: dict[int, frozenset[int]] = {}
    sent: list[KvUpdate] = []
    for seq, (ops, fate) in enumerate(stream):
        for kind, keys in ops:
            if kind == "cleared":
                truth.clear()
            elif kind == "stored":
                truth.update(keys)
            else:
                truth.difference_update(keys)
        truth_at[seq] = frozenset(truth)
        update = _update(seq, ops)
        if fate == "lost":
            continue
        sent.append(update)
        if fate == "dup":
            sent.append(update)
        elif fate == "swap" and len(sent) >= 2:
            sent[-1], sent[-2] = sent[-2], sent[-1]
    # The replica's set is empty before seq 0: a snapshot of nothing starts the index.
    index.apply(KvUpdate("c", "r1", "d", "e1", 0, (), snapshot=True))
    applied_seq = 0
    # seq 0 is the snapshot above; replay the rest (shifted by one) as deltas.
    for u in sent:
        outcome = index.apply(KvUpdate(u.cluster, u.replica_id, u.deployment, u.epoch, u.seq + 1, u.ops))
        if outcome == "applied":
            applied_seq = u.seq
            held = {k for k in range(41) if index.holds("c", "r1", k)}
            assert held <= truth_at[applied_seq]
            assert len(held) <= cap
        else:  # stale or resync: still nothing beyond the truth at the last applied batch
            held = {k for k in range(41) if index.holds("c", "r1", k)}
            assert held <= truth_at[applied_seq] and (outcome == "stale" or not held)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(0, 10_000), max_size=50)), max_size=40),
    st.integers(1, 64),
    st.integers(1, 8),
)
def test_memory_is_bounded_in_blocks_and_replicas(snapshots, cap, max_replicas) -> None:
    index = PrefixIndex(max_blocks_per_replica=cap, max_replicas=max_replicas)
    for rid, keys in snapshots:
        index.apply(_update(0, [("stored", keys)], snapshot=True, rid=f"r{rid}"))
        assert len(index) <= max_replicas
        assert index.size <= cap * max_replicas


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 30), st.lists(st.integers(0, 10_000), max_size=50)),
        max_size=60,
    ),
    st.integers(1, 8),
    st.integers(1, 80),
)
def test_each_cluster_is_bounded_and_evicts_only_its_own(snapshots, per_cluster, cluster_blocks) -> None:
    """Whatever cluster "a" sends, it holds at most its replicas and blocks, and the other
    clusters' entries are never evicted for it (the overall bounds are not reached)."""
    index = PrefixIndex(
        max_blocks_per_replica=64, max_replicas_per_cluster=per_cluster, max_blocks_per_cluster=cluster_blocks
    )
    index.apply(KvUpdate("victim", "v", "d", "e", 0, (("stored", (7,)),), snapshot=True))
    for cluster, rid, keys in snapshots:
        index.apply(KvUpdate(cluster, f"r{rid}", "d", "e", 0, (("stored", tuple(keys)),), snapshot=True))
        for c in "abc":
            assert len(index.replicas(c, "d")) <= per_cluster
            assert index.cluster_blocks(c) <= max(cluster_blocks, 1)
        assert index.holds("victim", "v", 7)


def test_gap_restart_and_duplicates() -> None:
    index = PrefixIndex()
    assert index.apply(_update(3, [("stored", [1, 2])])) == "resync"  # first heard: a delta
    assert not index.holds("c", "r1", 1)
    assert index.apply(_update(3, [("stored", [1, 2])], snapshot=True)) == "applied"
    assert index.match("c", "r1", [1, 2, 3]) == 2
    assert index.apply(_update(3, [("removed", [1])])) == "stale"
    assert index.apply(_update(4, [("removed", [1])])) == "applied"
    assert index.match("c", "r1", [1, 2]) == 0 and index.holds("c", "r1", 2)
    assert index.apply(_update(6, [("stored", [5])])) == "resync"  # 5 lost
    assert not index.holds("c", "r1", 2)
    assert index.apply(_update(0, [("stored", [7])], epoch="e2", snapshot=True)) == "applied"
    assert index.apply(_update(1, [("stored", [8])], epoch="e1")) == "resync"  # an old epoch


def _engine_hashes(tokens: list[int], block_size: int, salt: str | None) -> set[bytes]:
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    req = Request(
        request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1), cache_salt=salt
    )
    assert kv.allocate_slots(req, len(tokens))
    return {h for h, _ in kv.block_pool.cached_items()}


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 49_151), min_size=1, max_size=200),
    st.sampled_from([4, 16, 32]),
    st.sampled_from([None, "tenant-a", "tenant-b"]),
)
def test_gateway_keys_are_the_engines_block_hashes_salt_included(tokens, block_size, salt) -> None:
    engine = {block_key(h) for h in _engine_hashes(tokens, block_size, salt)}
    ours = prefix_keys(tokens, block_size, salt)
    assert set(ours) == engine and len(ours) == len(tokens) // block_size
    other = "tenant-z" if salt != "tenant-z" else None
    assert not set(prefix_keys(tokens, block_size, other)) & engine  # another salt never matches


def test_wire_batch_to_index_update() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    batch = KvCacheBatch(
        cluster="c",
        deployment="d",
        replica_id="r1",
        epoch="e",
        seq=0,
        snapshot=True,
        ops=[KvCacheOp(kind="stored", block_hashes=[h.hex() for h in hashes])],
    )
    index = PrefixIndex()
    assert index.apply(to_update(KvCacheBatch.from_bytes(batch.to_bytes()))) == "applied"
    assert index.match("c", "r1", [block_key(h) for h in hashes]) == 3
