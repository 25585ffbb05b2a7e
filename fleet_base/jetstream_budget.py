"""JetStream's storage budget: how many bytes each stream and bucket of the wire contract
may hold, and the server store that holds them all.

Every stream the fleet creates has `max_bytes`, and nats-server counts a stream's
`max_bytes` as reserved from the moment it is created: the sum of the reservations fits
in `max_file_store` (the generated server config sets it from the same budget), so the KV
buckets (desired state, routes, keys and their revocations and lease) always have their
room, however much the event and usage streams are sent. Those two streams drop their
oldest messages when full (discard old) and cap each subject, that is each cluster
(`fleet.v1.<kind>.<cluster>`), at a quarter of the stream (`max_msgs_per_subject` times
`max_msg_size`), so one cluster flooding them evicts its own records first.

One knob: `FLEET_JETSTREAM_STORE_BYTES` (default 2 GiB), read by `fleetctl` when it writes
the server config and by the control plane when it creates the streams; the shares below
divide it. A bigger store keeps more history through a control-plane outage.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from fleet_base import protocol
from fleet_base.batch import names as batch

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_STORE_BYTES = 2 * GIB
MIN_STORE_BYTES = 16 * MIB
STORE_ENV = "FLEET_JETSTREAM_STORE_BYTES"
WEEK_S = 7 * 24 * 3600.0
SUBJECT_SHARE = 4  # one subject (cluster) holds at most 1/SUBJECT_SHARE of its stream

# share of the store per stream or bucket; the rest is headroom (consumer state, metadata).
# Usage keeps the largest share (it is the bill). Batch file contents come next: a batch's
# input and output files live there until deleted. The work queue holds a whole batch at
# the default store (its items are about the size of its input file, up to
# `BatchConfig.max_file_bytes`); when full it refuses new items and the driver enqueues
# the rest later, as workers drain it.
SHARES: dict[str, float] = {
    f"KV_{protocol.BUCKET_DESIRED}": 0.04,
    f"KV_{protocol.BUCKET_ROUTES}": 0.02,
    f"KV_{protocol.BUCKET_KEYS}": 0.02,
    protocol.STREAM_EVENTS: 0.12,
    protocol.STREAM_USAGE: 0.28,
    f"KV_{batch.BUCKET_FILES}": 0.005,
    f"KV_{batch.BUCKET_BATCHES}": 0.005,
    f"KV_{batch.BUCKET_RESULTS}": 0.08,
    f"KV_{batch.BUCKET_ASYNC}": 0.01,
    f"OBJ_{batch.OBJECT_BUCKET_FILES}": 0.20,
    batch.STREAM_WORK: 0.115,
    batch.STREAM_WEBHOOKS: 0.005,
}
# largest message each stream stores: a UsageRecord is ~0.5 KB, an Event at most 4096
# characters of text (escaped in JSON)
MAX_MSG_SIZE: dict[str, int] = {protocol.STREAM_EVENTS: 20 * 1024, protocol.STREAM_USAGE: 2 * 1024}
# largest item of a bucket or queue that has no per-subject cap (each key or item is its
# own subject): a work item carries one request body, a result one response body (an
# embedding of a long input included); the server's max_payload is the bound beyond
MAX_ITEM_SIZE: dict[str, int] = {
    batch.STREAM_WORK: MIB,
    f"KV_{batch.BUCKET_RESULTS}": MIB,
    batch.STREAM_WEBHOOKS: 1024,
}


class StreamLimits(BaseModel):
    max_bytes: int = Field(gt=0)
    max_msg_size: int = -1
    max_msgs_per_subject: int = -1
    max_age_s: float = 0.0  # 0: no age limit


class JetStreamBudget(BaseModel):
    store_bytes: int = Field(DEFAULT_STORE_BYTES, ge=MIN_STORE_BYTES)
    memory_bytes: int = Field(256 * MIB, gt=0)  # nothing of ours is in memory: a cap only

    @classmethod
    def from_env(cls) -> JetStreamBudget:
        raw = os.environ.get(STORE_ENV, "").strip()
        return cls(store_bytes=int(raw)) if raw else cls()

    def limits(self, stream: str) -> StreamLimits:
        """The limits of one stream (`KV_<bucket>` for a bucket)."""
        max_bytes = int(self.store_bytes * SHARES[stream])
        if stream in MAX_ITEM_SIZE:
            return StreamLimits(max_bytes=max_bytes, max_msg_size=min(MAX_ITEM_SIZE[stream], max_bytes))
        size = MAX_MSG_SIZE.get(stream)
        if size is None:  # a KV bucket: history 1, bounded by bytes alone
            return StreamLimits(max_bytes=max_bytes)
        per_subject = max(1, max_bytes // (SUBJECT_SHARE * size))
        return StreamLimits(
            max_bytes=max_bytes, max_msg_size=size, max_msgs_per_subject=per_subject, max_age_s=WEEK_S
        )

    @property
    def reserved_bytes(self) -> int:
        return sum(self.limits(name).max_bytes for name in SHARES)
