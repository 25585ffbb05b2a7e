"""Engine block hashes -> Fleet's: the translation is Fleet's own chained hash of the same
token ids (the property), and its bounds and drops (the table)."""

from __future__ import annotations

import hashlib
import itertools

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from agent.engine_kv_translate import FleetHashTranslator
from agent.gateway.prefix import prefix_keys
from fleet_base.block_hash import hash_request_blocks
from fleet_base.engine_kv_events import (
    AllCleared,
    KvEventDecodeError,
    RemovedBlocks,
    StoredBlocks,
    decode_engine_events,
)


def eh(*parts: object) -> str:
    """An engine-style hash as hex (not Fleet's scheme)."""
    return hashlib.md5(repr(parts).encode()).hexdigest().rjust(64, "0")


def chain_events(
    tokens: list[int], bs: int, salt: str | None, cuts: list[int], tier: str = "device"
) -> list[StoredBlocks]:
    """The full blocks of `tokens` as stored events, split after the block counts in `cuts`
    (an engine stores a prompt's blocks over several steps), hashed the engine's way."""
    n = len(tokens) // bs
    bounds = sorted({c for c in cuts if 0 < c < n} | {0, n})
    events, parent = [], None
    for a, b in itertools.pairwise(bounds):
        hashes = tuple(eh(salt, tokens[: (i + 1) * bs]) for i in range(a, b))
        events.append(
            StoredBlocks(hashes, parent, tokens[a * bs : b * bs], bs, tier, salt if parent is None else None)
        )
        parent = hashes[-1]
    return events


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=200),
    bs=st.sampled_from([1, 4, 16]),
    salt=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_translated_hashes_are_fleets_own(
    tokens: list[int], bs: int, salt: str | None, cuts: list[int]
) -> None:
    t = FleetHashTranslator()
    out = t.apply(chain_events(tokens, bs, salt, cuts))
    published = [h for kind, hashes, _ in out.ops if kind == "stored" for h in hashes]
    assert published == [h.hex() for h in hash_request_blocks(tokens, bs, salt)]
    # what the gateway looks up for this prompt is exactly what was published
    keys = prefix_keys(tokens, bs, salt)
    assert [int(h[:16], 16) for h in published] == list(keys)
    assert out.outcomes["stored"] == len(tokens) // bs


@given(
    a=st.lists(st.integers(0, 50), min_size=8, max_size=40),
    b=st.lists(st.integers(0, 50), min_size=8, max_size=40),
)
def test_same_tokens_same_hashes_whatever_the_engine_hash(a: list[int], b: list[int]) -> None:
    """Two replicas with different engine hash seeds publish the same Fleet hashes for the same
    chain; different chains share exactly their common full-block prefix."""
    t1, t2 = FleetHashTranslator(), FleetHashTranslator()
    e1 = chain_events(a, 4, None, [1])
    e2 = [
        StoredBlocks(
            tuple(eh("seed2", h) for h in e.block_hashes),
            None if e.parent is None else eh("seed2", e.parent),
            e.token_ids,
            4,
            "device",
        )
        for e in chain_events(a, 4, None, [1])
    ]
    h1 = [h for _, hs, _ in t1.apply(e1).ops for h in hs]
    h2 = [h for _, hs, _ in t2.apply(e2).ops for h in hs]
    assert h1 == h2
    t3 = FleetHashTranslator()
    h3 = [h for _, hs, _ in t3.apply(chain_events(b, 4, None, [])).ops for h in hs]
    common = 0
    while (
        common < min(len(a), len(b)) // 4 and a[common * 4 : common * 4 + 4] == b[common * 4 : common * 4 + 4]
    ):
        common += 1
    assert sum(x == y for x, y in zip(h1, h3, strict=False)) == common


def test_drops_are_counted_and_nothing_wrong_is_claimed() -> None:
    t = FleetHashTranslator()
    tokens = list(range(12))
    (first,) = chain_events(tokens, 4, None, [])
    cases = [
        # (event, outcome counted, ops published)
        (StoredBlocks(("a" * 64,), "f" * 64, [1, 2, 3, 4], 4, "device"), "unknown_parent", 0),
        (StoredBlocks(("b" * 64,), None, [1, 2, 3], 4, "device"), "malformed", 0),
        (StoredBlocks(("c" * 64,), None, [1, "x", 3, 4], 4, "device"), "malformed", 0),
        (StoredBlocks(("d" * 64,), None, [1] * 4, 4, "device", group=1), "group", 0),
        (first, "stored", 1),
        (StoredBlocks(("e" * 64,), None, [1] * 8, 8, "device"), "block_size", 0),  # not the first's 4
        (RemovedBlocks(("9" * 64,), "device"), "unknown_block", 0),
        (RemovedBlocks((first.block_hashes[0],), "host"), "unknown_block", 0),  # not in that tier
        (RemovedBlocks((first.block_hashes[2],), "device"), "removed", 1),
    ]
    for event, outcome, n_ops in cases:
        out = t.apply([event])
        assert out.outcomes[outcome] >= 1, (event, out.outcomes)
        assert len(out.ops) == n_ops, (event, out.ops)
    held = t.held()
    assert [len(h) for _, h, _ in held] == [2]
    assert t.apply([AllCleared()]).ops == [("cleared", [], "device")] and t.held() == [] and len(t) == 0


def test_the_bound_publishes_the_removal_of_what_it_forgets() -> None:
    t = FleetHashTranslator(max_blocks=3)
    events = chain_events(list(range(20)), 4, None, [])
    out = t.apply(events)
    fleet = [h.hex() for h in hash_request_blocks(list(range(20)), 4)]
    assert out.ops == [("stored", fleet, "device"), ("removed", fleet[:2], "device")]
    assert out.outcomes["evicted"] == 2 and len(t) == 3


def test_forget_held_keeps_translations_for_children() -> None:
    t = FleetHashTranslator()
    tokens = list(range(16))
    first, second = chain_events(tokens, 4, "s", [2])
    t.apply([first])
    t.forget_held()
    assert t.held() == []
    assert t.apply([RemovedBlocks(first.block_hashes, "device")]).ops == []  # not held: no removal
    out = t.apply([second])  # its parent is known: placed
    assert out.ops[0][1] == [h.hex() for h in hash_request_blocks(tokens, 4, "s")[2:]]


def test_a_reused_engine_hash_releases_the_old_block() -> None:
    t = FleetHashTranslator()
    a = StoredBlocks(("1" * 64,), None, [1, 2], 2, "device")
    b = StoredBlocks(("1" * 64,), None, [3, 4], 2, "device")
    t.apply([a])
    out = t.apply([b])
    old, new = (hash_request_blocks(x, 2)[0].hex() for x in ([1, 2], [3, 4]))
    assert out.ops == [("removed", [old], "device"), ("stored", [new], "device")]


_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "type"]),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-9, 9)), inner, max_size=6),
    ),
    max_leaves=40,
)
_event = st.one_of(
    _value,
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved"]), st.lists(_value, max_size=9)).map(
        lambda t: [t[0], *t[1]]
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved"])},
        optional={
            "block_hashes": st.lists(
                st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=40), _scalar), max_size=4
            ),
            "parent_block_hash": _value,
            "token_ids": st.lists(_scalar, max_size=40),
            "block_size": st.one_of(st.integers(-2, 20), _scalar),
            "medium": _value,
            "extra_keys": _value,
            "group_idx": _value,
        },
    ),
)


@given(batch=st.one_of(_value, st.tuples(st.floats(allow_nan=False), st.lists(_event, max_size=6)).map(list)))
def test_any_payload_is_decoded_or_refused_and_translated_without_error(batch: object) -> None:
    """Whatever bytes a replica sends: KvEventDecodeError or events the translator takes."""
    try:
        decoded = decode_engine_events(msgpack.packb(batch))
    except KvEventDecodeError:
        return
    FleetHashTranslator(max_blocks=8).apply(decoded.events)
