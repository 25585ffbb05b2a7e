"""vLLM's and SGLang's KV events decoded into Fleet ops. The bytes are made by msgspec's
msgpack encoder (what both engines publish with) from structs laid out as each release
declares them (below: stand-ins of the engines' classes, not the engines themselves)."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.engine_kv_layouts import (
    MBatch,
    MCleared,
    MRemoved,
    MStored,
    SgBatch,
    SgCleared,
    SgRemoved,
    SgStored,
    VBatch,
    VRemoved,
    VStored,
)
from fleet_base.engine_kv_events import (
    EngineKvEvents,
    KvEventDecodeError,
    block_hash_hex,
    decode_kv_event_batch,
    decode_zmq_message,
)
from fleet_base.kv_events import MAX_BATCH_HASHES, KvCacheOp

enc = msgspec.msgpack.Encoder()
H1, H2 = bytes(range(32)), bytes(range(32, 64))


def op(kind: str, hashes: list[object], tier: str = "device") -> KvCacheOp:
    return KvCacheOp(kind=kind, block_hashes=[block_hash_hex(h) for h in hashes], tier=tier)


def test_sglang_array_layout() -> None:
    payload = enc.encode(
        SgBatch(
            ts=1.5,
            events=[
                SgStored([11, -7], None, list(range(32)), 16, None),
                SgRemoved([11]),
                SgCleared(),
            ],
        )
    )
    assert payload[:1] == b"\x92"  # a 2-array: the array-like layout, not a map
    assert decode_kv_event_batch(payload) == EngineKvEvents(
        ts=1.5,
        block_size=16,
        ops=[op("stored", [11, -7]), op("removed", [11]), KvCacheOp(kind="cleared")],
    )


def test_vllm_array_layout_with_medium_and_rank() -> None:
    payload = enc.encode(
        VBatch(
            ts=2.0,
            events=[
                VStored([H1, H2], None, list(range(32)), 16, None, "GPU"),
                VStored([H1], None, list(range(16)), 16, None, "CPU"),
                VRemoved([H2], "GPU"),
                VRemoved([H1], "CPU"),
            ],
            data_parallel_rank=3,
        )
    )
    got = decode_kv_event_batch(payload)
    assert (got.ts, got.data_parallel_rank, got.block_size, got.skipped) == (2.0, 3, 16, 0)
    assert got.ops == [
        op("stored", [H1, H2], "device"),
        op("stored", [H1], "host"),
        op("removed", [H2], "device"),
        op("removed", [H1], "host"),
    ]
    assert got.ops[0].block_hashes[0] == H1.hex()  # a 32-byte hash is its own hex


def test_vllm_map_layout_and_unknown_medium_skipped() -> None:
    payload = enc.encode(
        MBatch(
            ts=3.0,
            events=[
                MStored([H1], 99, [1] * 16, 16, None, "GPU", "adapter-a", [None], 0),
                MStored([H2], None, [2] * 16, 16, None, "DISK", None),
                MRemoved([H1], None),
                MCleared(),
            ],
            data_parallel_rank=0,
        )
    )
    assert payload[:1] == b"\x83"  # a 3-map
    got = decode_kv_event_batch(payload)
    assert got.ops == [op("stored", [H1]), op("removed", [H1]), KvCacheOp(kind="cleared")]
    assert (got.skipped, got.data_parallel_rank) == (1, 0)


def test_zmq_multipart_message() -> None:
    payload = enc.encode(SgBatch(ts=1.0, events=[SgCleared()]))
    seq, batch = decode_zmq_message([b"kv-events", (41).to_bytes(8, "big"), payload])
    assert seq == 41 and batch.ops == [KvCacheOp(kind="cleared")]


def test_a_long_stored_event_is_split_under_the_wire_bound() -> None:
    hashes = list(range(MAX_BATCH_HASHES * 2 + 5))
    got = decode_kv_event_batch(enc.encode(SgBatch(ts=0.0, events=[SgStored(hashes, None, [], 16, None)])))
    assert [len(o.block_hashes) for o in got.ops] == [MAX_BATCH_HASHES, MAX_BATCH_HASHES, 5]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"ts": "now", "events": []}),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, [["BlockMoved", [1]]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [], 0, None]]]),  # block_size 0
        msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]),  # a float hash
        msgpack.packb([1.0, [["BlockRemoved", [True]]]]),
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        msgpack.packb([1.0, [42]]),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_kv_event_batch(payload)


def test_block_hash_hex() -> None:
    assert block_hash_hex(1) == "0" * 63 + "1"
    assert block_hash_hex(-1) == "f" * 64
    assert block_hash_hex(b"\x01\x02") == "0" * 60 + "0102"
    assert len(block_hash_hex(b"x" * 40)) == 64


hashes = st.lists(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32)), max_size=40
)
events = st.lists(
    st.one_of(
        st.builds(
            lambda h, m: VStored(h, None, [], 16, None, m), hashes, st.sampled_from([None, "GPU", "CPU"])
        ),
        st.builds(VRemoved, hashes, st.sampled_from([None, "GPU", "CPU"])),
    ),
    max_size=30,
)


@given(events=events, rank=st.none() | st.integers(0, 64))
def test_any_vllm_batch_round_trips(events: list[Any], rank: int | None) -> None:
    got = decode_kv_event_batch(enc.encode(VBatch(ts=9.0, events=events, data_parallel_rank=rank)))
    tiers = {None: "device", "GPU": "device", "CPU": "host"}
    expected = [
        op("stored" if isinstance(e, VStored) else "removed", e.block_hashes, tiers[e.medium])
        for e in events
        if e.block_hashes  # an event without hashes changes nothing
    ]
    assert got.ops == expected and got.data_parallel_rank == rank
