"""Prefix-cache events on the wire: which KV blocks each replica holds, relayed by its agent
on `fleet.v1.kvcache.<cluster>` so gateways route a request to the replica that already
cached its prefix; a gateway that lost track asks on `fleet.v1.kvresync.<cluster>`.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from fleet_base.protocol import SUBJECT_PREFIX, Message


def kvcache_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.kvcache.{cluster}"


def kvresync_subject(cluster: str) -> str:
    """Where a gateway asks a cluster's agent for a replica's full prefix-cache set."""
    return f"{SUBJECT_PREFIX}.kvresync.{cluster}"


KVCACHE_WILDCARD = f"{SUBJECT_PREFIX}.kvcache.*"

# What one batch may carry. A reader refuses a bigger message by its length alone, before
# parsing it (the relay's largest batch is ~80 KB: MAX_BATCH_HASHES hashes in MAX_BATCH_OPS ops).
MAX_BATCH_HASHES = 1024
MAX_BATCH_OPS = 256
MAX_BATCH_BYTES = 128 * 1024
_HASH = re.compile(r"[0-9a-f]{64}")


Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")


class KvCacheOp(BaseModel):
    """Blocks that became cached (full and hashed), were evicted, or the whole cache was
    dropped, in the engine's chained sha256 scheme (hex).

    `tier` says where a stored or removed block lives: in the device KV pool or in the
    host-memory tier below it (vLLM's events call it `medium`). A block may be in both; a
    removal names the one copy that went. An op without it is a device op (what every
    engine sent before the host tier), so old payloads read as they always did; a device op
    is sent without it, so a reader that predates tiers reads it too. "cleared" drops every
    tier."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[str] = Field(default_factory=list, max_length=MAX_BATCH_HASHES)
    tier: Tier = "device"

    @model_serializer(mode="wrap")
    def _device_is_implied(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tier") == "device":
            del out["tier"]
        return out

    @field_validator("block_hashes")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        full = _HASH.fullmatch
        if not all(full(h) for h in v):
            raise ValueError("a block hash is 64 lower-case hex digits")
        return v


class KvCacheBatch(Message):
    """One batch of a replica's prefix-cache changes, on `fleet.v1.kvcache.<cluster>`.

    `seq` is consecutive within `epoch` (a new epoch when the replica or the agent's relay
    restarts); `snapshot` batches carry the replica's full set and replace what a reader
    knew. A reader that sees a gap asks for a snapshot on `fleet.v1.kvresync.<cluster>`.
    Hashes are rooted in the request's cache salt, so a salted (per-tenant) block only
    matches requests under the same salt; the salt itself never travels."""

    cluster: str = Field(max_length=63)
    deployment: str = Field(max_length=128)
    replica_id: str = Field(max_length=128)
    epoch: str = Field(min_length=1, max_length=128)
    seq: int = Field(ge=0, le=2**62)
    snapshot: bool = False
    block_size: int = Field(16, ge=1, le=1 << 20)
    ops: list[KvCacheOp] = Field(default_factory=list, max_length=MAX_BATCH_OPS)
    at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _bounded(self) -> KvCacheBatch:
        if sum(len(op.block_hashes) for op in self.ops) > MAX_BATCH_HASHES:
            raise ValueError(f"a batch carries at most {MAX_BATCH_HASHES} block hashes")
        return self


ALL_REPLICAS = "*"


class KvResyncRequest(Message):
    """A gateway lost track of a replica's prefix cache (or, `replica_id` "*", of every
    replica of the cluster: it just connected): send the full set again."""

    cluster: str
    replica_id: str
    requester: str = ""
