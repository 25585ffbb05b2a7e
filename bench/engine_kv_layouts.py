"""Stand-ins of vLLM's and SGLang's KV-event classes, laid out as each release declares them
(not the engines themselves): the bytes msgspec's msgpack encoder (what both engines publish
with) makes from them are what Fleet's decoder, subscriber tests and benchmark are fed."""

from __future__ import annotations

from typing import Any

import msgspec

ARRAY = {"array_like": True, "omit_defaults": True, "gc": False}


# SGLang (sglang/srt/disaggregation/kv_events.py) and vLLM before the host tier.
class SgBatch(msgspec.Struct, **ARRAY):
    ts: float
    events: list[Any]


class SgEvent(msgspec.Struct, tag=True, **ARRAY):
    pass


class SgStored(SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SgRemoved(SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SgCleared(SgEvent, tag="AllBlocksCleared"):
    pass


# vLLM with `medium` and the data-parallel rank, still array-like (its kv_events_subscriber example).
class VBatch(msgspec.Struct, **ARRAY):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, tag=True, **ARRAY):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


# Later vLLM: the same tagged structs without array_like (maps with a "type" key), more fields.
MAP = {"omit_defaults": True, "gc": False}


class MBatch(msgspec.Struct, **MAP):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MEvent(msgspec.Struct, tag=True, **MAP):
    pass


class MStored(MEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MRemoved(MEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MCleared(MEvent, tag="AllBlocksCleared"):
    pass
