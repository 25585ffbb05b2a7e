"""The host KV tier's bookkeeping: LRU within a capacity in bytes, pins that hold a slot
being loaded, offloads of evicted device blocks and a prefix lookup that continues from
the device into the host tier. A property test plays scheduler and "model" over block and
slot contents and checks every hit reads the KV its hash names."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import HostTier, KVCacheManager, KvEventLog, KvTransfer
from engine.request import Request
from fleet_base.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1))


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _events(log: KvEventLog) -> list[tuple[str, list[bytes], str]]:
    return log.read(log.epoch, 0).ops


def test_capacity_is_in_bytes_and_eviction_is_lru() -> None:
    log = KvEventLog(BS)
    log.read(None, None)
    tier = HostTier(capacity_bytes=3 * 100 + 99, block_bytes=100, events=log)
    assert tier.num_slots == 3
    slots = [tier.store(_h(i)) for i in range(3)]
    assert sorted(slots) == [0, 1, 2]  # type: ignore[type-var]
    assert tier.store(_h(0)) is None  # held already: no copy, now most recently used
    slot = tier.store(_h(3))  # full: the least recently used (1) goes
    assert slot == slots[1] and _h(1) not in tier and tier.hashes() == [_h(2), _h(0), _h(3)]
    ops = _events(log)
    assert ("removed", [_h(1)], "host") in ops
    assert all(tier_ == "host" for _, _, tier_ in ops)
    assert HostTier(capacity_bytes=99, block_bytes=100).store(_h(0)) is None  # no slot at all


def test_a_pinned_slot_is_never_evicted_or_reused() -> None:
    tier = HostTier(capacity_bytes=200, block_bytes=100)
    a, b = tier.store(_h(0)), tier.store(_h(1))
    assert tier.pin(_h(0)) == a  # also most recently used: _h(1) is now the oldest
    tier.pin(_h(1))
    assert tier.store(_h(2)) is None  # every slot is being read: the offload is dropped
    assert not tier.clear()
    tier.unpin(b)  # type: ignore[arg-type]
    assert tier.store(_h(2)) == b and _h(0) in tier
    tier.unpin(a)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tier.unpin(a)  # type: ignore[arg-type]


def _manager(num_blocks: int, host_slots: int, log: KvEventLog | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, events=log, host_tier=HostTier(host_slots * 10, 10, log))


def test_evicted_blocks_are_offloaded_and_a_lookup_continues_into_the_host() -> None:
    log = KvEventLog(BS)
    log.read(None, None)
    kv = _manager(num_blocks=4, host_slots=8, log=log)
    a = _req("a", list(range(9)))  # two full blocks + one
    assert kv.allocate_slots(a, 9)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.take_transfers() == []
    b = _req("b", list(range(100, 113)))  # four blocks: a's two cached blocks are evicted
    assert kv.allocate_slots(b, 13)
    offloads = kv.take_transfers()
    assert [t.kind for t in offloads] == ["offload", "offload"]
    assert {t.block_id for t in offloads} == set(a_blocks[:2])
    kv.transfers_done(offloads)
    assert kv.tier_stats.bytes["offload"] == 20
    ops = _events(log)
    kinds = [(k, t) for k, _, t in ops]
    # Each offloaded block is stored on the host, then removed from the device.
    assert kinds[1:5] == [("stored", "host"), ("removed", "device")] * 2
    kv.free(b)

    # a again: nothing on the device, both full blocks in the host tier (not the last token's).
    a2 = _req("a2", list(range(9)))
    hit = kv.find_prefix(a2)
    assert hit.block_ids == [] and len(hit.host_hashes) == 2 and hit.num_computed_tokens == 8
    assert kv.allocate_slots(a2, 1, hit.block_ids, hit.host_hashes)
    moves = kv.take_transfers()
    loads = [t for t in moves if t.kind == "load"]
    assert [t.block_id for t in loads] == kv.get_block_ids("a2")[:2]
    assert moves[-2:] == loads  # loads after the offloads the same allocation caused
    assert all(kv.host.is_pinned(t.slot) for t in loads)  # type: ignore[union-attr]
    kv.transfers_done(moves)
    assert not any(kv.host.is_pinned(t.slot) for t in loads)  # type: ignore[union-attr]
    assert kv.tier_stats.hits == {"device": 0, "host": 2}
    assert ("stored", "device") in [(k, t) for k, _, t in _events(log)[len(ops) :]]

    # Device first, then host: a request sharing a2's prefix hits the device now.
    kv.free(a2)
    hit = kv.find_prefix(_req("a3", list(range(9))))
    assert len(hit.block_ids) == 2 and hit.host_hashes == []


def test_host_hits_are_pinned_against_the_offloads_of_their_own_allocation() -> None:
    """A one-slot host tier: loading its block needs a device block whose eviction offers
    another block to the tier, which must not take the slot being read."""
    kv = _manager(num_blocks=2, host_slots=1)
    a = _req("a", list(range(5)))
    assert kv.allocate_slots(a, 5)
    kv.free(a)
    b = _req("b", list(range(50, 55)))
    assert kv.allocate_slots(b, 5)  # evicts a's block 0 into the only slot
    kv.transfers_done(kv.take_transfers())
    kv.free(b)  # b's cached block now sits in the free queue
    a2 = _req("a2", list(range(5)))
    hit = kv.find_prefix(a2)
    assert len(hit.host_hashes) == 1
    assert kv.allocate_slots(a2, 1, hit.block_ids, hit.host_hashes)
    moves = kv.take_transfers()
    assert [t.kind for t in moves] == ["load"]  # b's evicted block found no free slot
    assert hit.host_hashes[0] in kv.host  # type: ignore[operator]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans()),
        min_size=1,
        max_size=60,
    ),
    st.integers(2, 9),
    st.integers(0, 3),
)
def test_every_hit_reads_the_kv_its_hash_names(script, num_blocks, host_slots) -> None:
    """Contents are simulated: a step writes each new block with the hash of its tokens;
    copies move contents in the order queued. Requests share prefixes of one of six
    token streams; some stay running (held) so pools fill and evictions interleave."""
    kv = _manager(num_blocks=num_blocks, host_slots=host_slots)
    device: dict[int, object] = {}
    host: dict[int, object] = {}
    held: list[Request] = []
    for n, (stream, length, hold) in enumerate(script):
        req = _req(f"r{n}", [stream * 1000 + t for t in range(length)])
        hit = kv.find_prefix(req)
        if not kv.allocate_slots(
            req, req.num_tokens - hit.num_computed_tokens, hit.block_ids, hit.host_hashes
        ):
            for r in held:
                kv.free(r)
            held.clear()
            continue
        moves: list[KvTransfer] = kv.take_transfers()
        for t in moves:
            if t.kind == "offload":
                host[t.slot] = device.get(t.block_id)
            else:
                device[t.block_id] = host.get(t.slot)
        kv.transfers_done(moves)
        table = kv.get_block_ids(req.request_id)
        computed = hit.num_computed_tokens // BS
        for i, block in enumerate(table):
            want = ("kv", stream, i) if (i + 1) * BS <= length else None
            if i < computed:
                assert device.get(block) == want, (n, i)
            device[block] = want  # the step writes the rest (a partial block: not a prefix)
        req.num_computed_tokens = req.num_tokens
        if hold:
            held.append(req)
        else:
            kv.free(req)


def test_a_hit_runs_on_the_device_then_continues_in_the_host_tier() -> None:
    kv = _manager(num_blocks=5, host_slots=8)
    a = _req("a", list(range(13)))  # three full blocks + one token
    assert kv.allocate_slots(a, 13)
    first = kv.get_block_ids("a")[0]
    kv.free(a)  # tail first: a's first block is evicted last
    b = _req("b", list(range(100, 116)))  # four blocks: evicts a's blocks 2 and 1, not 0
    assert kv.allocate_slots(b, 16)
    kv.transfers_done(kv.take_transfers())
    kv.free(b)
    again = _req("a2", list(range(13)))
    hit = kv.find_prefix(again)
    assert hit.block_ids == [first] and len(hit.host_hashes) == 2 and hit.num_computed_tokens == 12
    assert kv.allocate_slots(again, 1, hit.block_ids, hit.host_hashes)
    table = kv.get_block_ids("a2")
    loads = [t for t in kv.take_transfers() if t.kind == "load"]
    assert table[0] == first and [t.block_id for t in loads] == table[1:3]
    assert kv.tier_stats.hits == {"device": 1, "host": 2}
