"""vLLM's and SGLang's KV-cache events, decoded into Fleet's prefix-cache wire ops.

Both engines publish on a ZMQ PUB socket (`--kv-events-config`) multipart messages
`(topic, seq as 8 bytes big-endian, payload)`, the payload a msgpack-encoded `KVEventBatch`
of tagged events `BlockStored`, `BlockRemoved` and `AllBlocksCleared` (msgspec structs, see
vllm/distributed/kv_events.py and sglang/srt/disaggregation/kv_events.py). Their layout has
moved between releases, and every one of them is read here:

- array-like (SGLang; vLLM until its structs dropped `array_like`): a batch is
  `[ts, events]` or `[ts, events, data_parallel_rank]`; an event is `[tag, *fields]` in
  declaration order, trailing defaulted fields possibly omitted;
- map (later vLLM): a batch is `{"ts", "events", "data_parallel_rank"}`; an event is a map
  whose `"type"` names it.

`medium` ("GPU", "CPU"; absent before vLLM had a host tier) becomes the op's tier; events of
a medium Fleet has no tier for (a disk or remote connector) are skipped and counted. Hashes are
the engine's own (ints, or bytes in later vLLM), carried as 64 hex digits; they are *not* in
Fleet's chained-sha256 scheme, so a router matches them only against prompts hashed the
engine's way. `decode_engine_events` keeps what re-hashing in Fleet's scheme needs (the
parent, the token ids, the cache salt of a chain's first block); the agent translates
(agent/engine_kv_translate.py). The decoder takes bytes: the ZMQ socket lives with the agent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import BaseModel, Field

from fleet_base.kv_events import MAX_BATCH_HASHES, KvCacheOp, Tier

MEDIUM_TIERS: dict[str | None, Tier] = {None: "device", "GPU": "device", "CPU": "host"}

# Field order of each event in the array-like layout (after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


class KvEventDecodeError(ValueError):
    """The payload is not a KV event batch in any layout the engines use."""


class EngineKvEvents(BaseModel):
    """One engine batch as Fleet ops, in the engine's order. `block_size` is the stored
    events' (None without one); `skipped` counts events of a medium without a Fleet tier."""

    ts: float
    data_parallel_rank: int | None = None
    block_size: int | None = None
    ops: list[KvCacheOp] = Field(default_factory=list)
    skipped: int = 0


def block_hash_hex(h: object) -> str:
    """An engine block hash as Fleet's 64 hex digits: an int modulo 2**256 (Python's `hash`
    may be negative), bytes of up to 32 left-padded, longer bytes by their sha256."""
    if isinstance(h, bool):
        raise KvEventDecodeError(f"a block hash is an int or bytes, not {h!r}")
    if isinstance(h, int):
        return f"{h % (1 << 256):064x}"
    if isinstance(h, bytes):
        return h.hex().rjust(64, "0") if len(h) <= 32 else hashlib.sha256(h).hexdigest()
    raise KvEventDecodeError(f"a block hash is an int or bytes, not {type(h).__name__}")


def zmq_seq(frame: bytes) -> int:
    """The sequence number frame of a published message (-1 ends a replay)."""
    if len(frame) != 8:
        raise KvEventDecodeError("a sequence frame is 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_zmq_message(frames: Sequence[bytes]) -> tuple[int, EngineKvEvents]:
    """A `(topic, seq, payload)` multipart message as its sequence number and batch."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"a KV event message has 3 frames, not {len(frames)}")
    return zmq_seq(frames[1]), decode_kv_event_batch(frames[2])


def decode_kv_event_batch(payload: bytes) -> EngineKvEvents:
    """The batch as Fleet ops carrying the engine's own hashes."""
    ts, events, rank = _unpack_batch(payload)
    out = EngineKvEvents(ts=ts, data_parallel_rank=rank)
    for event in events:
        _add_event(out, _event_fields(event))
    return out


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Consecutive full blocks an engine cached: `token_ids` are all of theirs in order
    (`block_size` each), `parent` the engine hash before the first (None: the first block
    of a prompt, whose Fleet parent is the root of `salt`, the request's cache salt when the
    engine reports it). `group` is vLLM's KV-cache group (None before hybrid models)."""

    block_hashes: tuple[str, ...]
    parent: str | None
    token_ids: list[Any]
    block_size: int
    tier: Tier
    salt: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    block_hashes: tuple[str, ...]
    tier: Tier
    group: int | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


EngineEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass
class EngineEventBatch:
    """One engine batch as typed events, in the engine's order (`skipped`: events of a
    medium without a Fleet tier)."""

    ts: float
    data_parallel_rank: int | None = None
    events: list[EngineEvent] = field(default_factory=list)
    skipped: int = 0


def decode_engine_events(payload: bytes, *, max_events: int | None = None) -> EngineEventBatch:
    """The batch with what translating it into Fleet's hashes needs. KvEventDecodeError for
    a payload in no engine layout, or with more than `max_events` events."""
    ts, events, rank = _unpack_batch(payload)
    if max_events is not None and len(events) > max_events:
        raise KvEventDecodeError(f"{len(events)} events in one batch (at most {max_events})")
    out = EngineEventBatch(ts=ts, data_parallel_rank=rank)
    for raw in events:
        fields = _event_fields(raw)
        tag = fields["type"]
        if tag == "AllBlocksCleared":
            out.events.append(AllCleared())
            continue
        medium = fields.get("medium")
        if not _known_medium(medium):
            out.skipped += 1
            continue
        hashes = fields.get("block_hashes")
        if not isinstance(hashes, list):
            raise KvEventDecodeError(f"{tag} without block_hashes")
        hexes = tuple(block_hash_hex(h) for h in hashes)
        group = fields.get("group_idx")
        group = group if isinstance(group, int) and not isinstance(group, bool) else None
        tier = MEDIUM_TIERS[medium]
        if tag == "BlockRemoved":
            out.events.append(RemovedBlocks(hexes, tier, group))
            continue
        size, tokens, parent = (
            fields.get("block_size"),
            fields.get("token_ids"),
            fields.get("parent_block_hash"),
        )
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise KvEventDecodeError("BlockStored without a positive block_size")
        if not isinstance(tokens, list):
            raise KvEventDecodeError("BlockStored without token_ids")
        salt = _root_salt(fields) if parent is None else None
        parent_hex = None if parent is None else block_hash_hex(parent)
        out.events.append(StoredBlocks(hexes, parent_hex, tokens, size, tier, salt, group))
    return out


def _known_medium(medium: object) -> bool:
    return (medium is None or isinstance(medium, str)) and medium in MEDIUM_TIERS


def _root_salt(fields: dict[str, Any]) -> str | None:
    """The cache salt vLLM hashed into a chain's first block: its extra keys are the LoRA
    name, multimodal keys, the salt (first block only), prompt-embedding hashes, in that
    order; the salt is the last string that is not the LoRA name."""
    keys = fields.get("extra_keys")
    if not isinstance(keys, list) or not keys or not isinstance(keys[0], list):
        return None
    lora = fields.get("lora_name")
    strings = [k for k in keys[0] if isinstance(k, str) and k != lora]
    return strings[-1] if strings else None


def _unpack_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise KvEventDecodeError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    else:
        raise KvEventDecodeError("a batch is [ts, events(, rank)] or a map")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise KvEventDecodeError("a batch has a numeric ts and a list of events")
    if rank is not None and not isinstance(rank, int):
        raise KvEventDecodeError("data_parallel_rank is an int")
    return float(ts), events, rank


def _event_fields(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        tag = event.get("type")
        fields = event
    elif isinstance(event, list) and event:
        tag = event[0]
        # Fields past the ones Fleet reads (added by later releases) are ignored.
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, event[1:], strict=False))
    else:
        raise KvEventDecodeError("an event is a tagged array or map")
    if not isinstance(tag, str) or tag not in _FIELDS:
        raise KvEventDecodeError(f"unknown KV event {tag!r}")
    return {**fields, "type": tag}


def _add_event(out: EngineKvEvents, fields: dict[str, Any]) -> None:
    tag = fields["type"]
    if tag == "AllBlocksCleared":
        out.ops.append(KvCacheOp(kind="cleared"))
        return
    medium = fields.get("medium")
    if not _known_medium(medium):
        out.skipped += 1
        return
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list):
        raise KvEventDecodeError(f"{tag} without block_hashes")
    if tag == "BlockStored":
        size = fields.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise KvEventDecodeError("BlockStored without a positive block_size")
        out.block_size = out.block_size or size
    kind = "stored" if tag == "BlockStored" else "removed"
    hexes = [block_hash_hex(h) for h in hashes]
    tier = MEDIUM_TIERS[medium]
    for i in range(0, len(hexes), MAX_BATCH_HASHES):
        out.ops.append(KvCacheOp(kind=kind, block_hashes=hexes[i : i + MAX_BATCH_HASHES], tier=tier))
