"""Prefix-cache events on the wire: which KV blocks each replica holds, relayed by its agent
on `fleet.v1.kvcache.<cluster>` so gateways route a request to the replica that already
cached its prefix; a gateway that lost track asks on `fleet.v1.kvresync.<cluster>`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet_base.protocol import SUBJECT_PREFIX, Message


def kvcache_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.kvcache.{cluster}"


def kvresync_subject(cluster: str) -> str:
    """Where a gateway asks a cluster's agent for a replica's full prefix-cache set."""
    return f"{SUBJECT_PREFIX}.kvresync.{cluster}"


KVCACHE_WILDCARD = f"{SUBJECT_PREFIX}.kvcache.*"


class KvCacheOp(BaseModel):
    """Blocks that became cached (full and hashed), were evicted, or the whole cache was
    dropped, in the engine's chained sha256 scheme (hex)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[str] = Field(default_factory=list, max_length=65536)

    @field_validator("block_hashes")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for h in v:
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError("a block hash is 64 lower-case hex digits")
        return v


class KvCacheBatch(Message):
    """One batch of a replica's prefix-cache changes, on `fleet.v1.kvcache.<cluster>`.

    `seq` is consecutive within `epoch` (a new epoch when the replica or the agent's relay
    restarts); `snapshot` batches carry the replica's full set and replace what a reader
    knew. A reader that sees a gap asks for a snapshot on `fleet.v1.kvresync.<cluster>`.
    Hashes are rooted in the request's cache salt, so a salted (per-tenant) block only
    matches requests under the same salt; the salt itself never travels."""

    cluster: str
    deployment: str
    replica_id: str
    epoch: str = Field(min_length=1, max_length=128)
    seq: int = Field(ge=0)
    snapshot: bool = False
    block_size: int = Field(16, ge=1)
    ops: list[KvCacheOp] = Field(default_factory=list, max_length=1024)
    at: float = Field(default_factory=time.time)


ALL_REPLICAS = "*"


class KvResyncRequest(Message):
    """A gateway lost track of a replica's prefix cache (or, `replica_id` "*", of every
    replica of the cluster: it just connected): send the full set again."""

    cluster: str
    replica_id: str
    requester: str = ""
