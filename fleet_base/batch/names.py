"""Names of the JetStream resources behind batch and async inference, and of their ids.

Every name is a wire contract: the gateways of every cluster, the control plane and the
generated nats-server permissions (`fleet_base.subjects`) read them from here.
"""

from __future__ import annotations

import secrets

# KV buckets (JetStream streams `KV_<bucket>`)
BUCKET_FILES = "fleet_files"  # key = file id -> FileRecord
BUCKET_BATCHES = "fleet_batches"  # key = batch id -> BatchRecord
BUCKET_RESULTS = "fleet_batch_results"  # key = "<batch id>.<line index>" | "async.<request id>" -> LineResult
BUCKET_ASYNC = "fleet_async"  # key = async request id -> AsyncRecord
# object store (JetStream stream `OBJ_<bucket>`) holding file contents when no s3:// is set
OBJECT_BUCKET_FILES = "fleet_files"

# work-queue streams: a message is removed when acknowledged
STREAM_WORK = "FLEET_BATCH_WORK"
STREAM_WEBHOOKS = "FLEET_WEBHOOKS"

WORK_SUBJECT_PREFIX = "fleet.v1.batch.work"
WEBHOOK_SUBJECT = "fleet.v1.async.webhook"
WEBHOOK_CONSUMER = "webhooks"  # the one durable consumer every gateway's delivery loop shares

# how long the results and async buckets keep an entry after its last write: a fixed bucket
# age (every gateway shares the bucket) above the default `BatchConfig.result_retention_s`
# (7 days), so a result outlives the retention a gateway states
RESULT_TTL_S = 8 * 24 * 3600.0

PRIORITIES = (0, 1, 2)  # 0 first; Baseten's convention
BATCH_PRIORITY = 2  # batch lines go after async requests of every priority
DEFAULT_ASYNC_PRIORITY = 1


def work_subject(deployment: str, priority: int, parent_id: str) -> str:
    """Where a work item of `parent_id` (a batch or async request id) for `deployment` at
    `priority` is queued. One durable consumer per (deployment, priority), filtered on
    `work_filter`, is shared by every gateway that serves the deployment; the parent id in
    the subject lets the stream count what of one batch is still queued."""
    return f"{WORK_SUBJECT_PREFIX}.{deployment}.p{priority}.{parent_id}"


def work_filter(deployment: str, priority: int) -> str:
    return f"{WORK_SUBJECT_PREFIX}.{deployment}.p{priority}.*"


def parent_filter(parent_id: str) -> str:
    return f"{WORK_SUBJECT_PREFIX}.*.*.{parent_id}"


def work_route(subject: str) -> tuple[str, int]:
    """(deployment, priority) of a `work_subject`."""
    deployment, priority, _ = subject.removeprefix(f"{WORK_SUBJECT_PREFIX}.").split(".")
    return deployment, int(priority.removeprefix("p"))


def work_consumer(deployment: str, priority: int) -> str:
    return f"batch-{deployment}-p{priority}"


def result_key(parent_id: str, index: int | None) -> str:
    """A line's result key: once per (batch, line); an async request's own key."""
    return f"async.{parent_id}" if index is None else f"{parent_id}.{index}"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_async_id() -> str:
    return f"async_{secrets.token_hex(12)}"


def line_request_id(batch_id: str, index: int) -> str:
    """The `id` of an output line (`batch_req_...`), stable across re-runs of the line."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def usage_record_id(parent_id: str, index: int | None) -> str:
    """The usage record id of a batch line or async request: the same on every run, so
    the control plane books a line re-run after a crash once (record ids are unique)."""
    return f"b:{result_key(parent_id, index)}"[:64]
