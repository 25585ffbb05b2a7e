"""Create (or bring to the budget) the JetStream resources of batch and async inference:
four KV buckets, the files object store, the work-queue stream and the webhook queue.
Idempotent; run by whoever creates the fleet's other streams (the control plane, the
unsecured `manage_jetstream` path), never by a gateway, which only binds.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from fleet_base.batch import names
from fleet_base.jetstream_budget import JetStreamBudget

DUPLICATE_WINDOW_S = 3600.0  # a re-enqueue within this is dropped by message id
# every bucket keeps one value per key; these are kept for `names.RESULT_TTL_S` after their last write
EXPIRING_BUCKETS = frozenset({names.BUCKET_RESULTS, names.BUCKET_ASYNC})
KV_BUCKETS = (names.BUCKET_FILES, names.BUCKET_BATCHES, names.BUCKET_RESULTS, names.BUCKET_ASYNC)
QUEUES = (
    (names.STREAM_WORK, f"{names.WORK_SUBJECT_PREFIX}.>"),
    (names.STREAM_WEBHOOKS, names.WEBHOOK_SUBJECT),
)


async def _bring_to(js: JetStreamContext, stream: str, wanted: dict) -> None:
    """Update an existing stream whose limits differ from `wanted`."""
    info = await js.stream_info(stream)
    config = info.config
    if any(getattr(config, k) != v for k, v in wanted.items()):
        for k, v in wanted.items():
            setattr(config, k, v)
        await js.update_stream(config)


async def ensure_batch_resources(js: JetStreamContext, budget: JetStreamBudget | None = None) -> None:
    budget = budget or JetStreamBudget.from_env()
    for bucket in KV_BUCKETS:
        stream = f"KV_{bucket}"
        limits = budget.limits(stream)
        ttl = names.RESULT_TTL_S if bucket in EXPIRING_BUCKETS else 0.0
        try:
            await js.stream_info(stream)
        except NotFoundError:
            await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    direct=True,
                    max_bytes=limits.max_bytes,
                    max_value_size=limits.max_msg_size,
                    ttl=ttl or None,
                    storage=StorageType.FILE,
                )
            )
            continue
        await _bring_to(
            js,
            stream,
            {
                "allow_direct": True,
                "max_bytes": limits.max_bytes,
                "max_msg_size": limits.max_msg_size,
                "max_age": ttl,
            },
        )

    obj_stream = f"OBJ_{names.OBJECT_BUCKET_FILES}"
    limits = budget.limits(obj_stream)
    try:
        await js.stream_info(obj_stream)
    except NotFoundError:
        await js.create_object_store(
            names.OBJECT_BUCKET_FILES,
            config=ObjectStoreConfig(
                bucket=names.OBJECT_BUCKET_FILES, max_bytes=limits.max_bytes, storage=StorageType.FILE
            ),
        )
    else:
        await _bring_to(js, obj_stream, {"max_bytes": limits.max_bytes})

    for stream, subject in QUEUES:
        limits = budget.limits(stream)
        wanted = {
            "max_bytes": limits.max_bytes,
            "max_msg_size": limits.max_msg_size,
            "duplicate_window": DUPLICATE_WINDOW_S,
            "discard": DiscardPolicy.NEW,  # a full queue refuses new work, never drops queued work
        }
        try:
            await js.stream_info(stream)
        except NotFoundError:
            await js.add_stream(
                StreamConfig(
                    name=stream,
                    subjects=[subject],
                    retention=RetentionPolicy.WORK_QUEUE,
                    storage=StorageType.FILE,
                    **wanted,
                )
            )
            continue
        await _bring_to(js, stream, wanted)
