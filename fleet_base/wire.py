"""Decoding of the wire contract (`fleet_base.protocol`): one decode function per message kind
that arrives on a subject, with the same checks wherever it is read.

Each decode parses the bytes (bounded: the models' own field limits), refuses a newer
major schema, checks that the message's cluster is the one its subject names (a sender
cannot speak for another cluster; NATS permissions bind each identity to its subjects),
and applies the kind's storage bounds. A refusal is a `Rejected` with a reason from
`REASONS` (the label of `fleet_control_plane_rejected_messages_total`); callers count or
drop it, never guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import ValidationError

from fleet_base import kv_events, protocol
from fleet_base.domain import is_cluster_id
from fleet_base.kv_events import KvCacheBatch, KvResyncRequest
from fleet_base.protocol import (
    MAX_USAGE_TOKENS,
    SCHEMA_VERSION,
    Demand,
    Event,
    Heartbeat,
    Message,
    UsageRecord,
)

M = TypeVar("M", bound=Message)

REASONS = ("malformed", "invalid", "subject", "schema", "database", "size", "rate")

__all__ = [
    "REASONS",
    "Rejected",
    "decode",
    "decode_demand",
    "decode_event",
    "decode_heartbeat",
    "decode_kv_batch",
    "decode_kv_resync",
    "decode_usage",
    "heartbeat_problem",
    "subject_cluster",
    "usage_problem",
]


class Rejected(ValueError):
    """A message refused on the way in: `reason` (one of REASONS) and a detail for the log."""

    def __init__(self, reason: str, detail: object) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def subject_cluster(subject: str) -> str:
    """The cluster a `fleet.v1.<kind>.<cluster>` subject names (its last token)."""
    return subject.rsplit(".", 1)[-1]


def heartbeat_problem(hb: Heartbeat) -> str | None:
    """Why a heartbeat cannot be stored (column widths, the cluster id rule), or None."""
    if not is_cluster_id(hb.cluster):
        return f"cluster id {hb.cluster[:80]!r} is not [a-z0-9-], 1-63 characters"
    for name, value, width in (
        ("provider", hb.provider, 63),
        ("region", hb.region, 63),
        ("gateway_url", hb.gateway_url, 512),
    ):
        if len(value) > width:
            return f"{name} is longer than {width} characters"
    names = [p.name for p in hb.pools]
    if len(set(names)) != len(names):
        return "pool names repeat"
    for p in hb.pools:
        if not p.name or len(p.name) > 63 or len(p.gpu_model) > 63:
            return f"pool {p.name[:80]!r}: name and gpu_model must be 1-63 characters"
    return None


def usage_problem(r: UsageRecord) -> str | None:
    """Why a usage record cannot be stored (column widths, token ranges), or None."""
    for name, value, width in (
        ("cluster", r.cluster, 63),
        ("key_id", r.key_id, 32),
        ("deployment", r.deployment, 63),
    ):
        if not value or len(value) > width:
            return f"{name} must be 1-{width} characters"
    for name, value in (("prompt_tokens", r.prompt_tokens), ("completion_tokens", r.completion_tokens)):
        if not 0 <= value <= MAX_USAGE_TOKENS:
            return f"{name} out of range"
    return None


def decode(
    model: type[M],
    subject: str,
    data: bytes | str,
    subject_for: Callable[[str], str] | None,
    problem: Callable[[M], str | None] | None = None,
) -> M:
    """`model` from `data` received on `subject`, or Rejected: malformed, schema (a newer
    major version), subject (the message's cluster is not the subject's), invalid."""
    try:
        message = model.from_bytes(data)
    except (ValidationError, ValueError) as err:
        raise Rejected("malformed", err) from None
    if message.schema_version > SCHEMA_VERSION:
        raise Rejected("schema", f"newer schema {message.schema_version}")
    cluster = getattr(message, "cluster", None)
    if subject_for is not None and (not isinstance(cluster, str) or subject != subject_for(cluster)):
        raise Rejected("subject", f"cluster {str(cluster)[:80]!r}")
    found = problem(message) if problem is not None else None
    if found is not None:
        raise Rejected("invalid", found)
    return message


def decode_heartbeat(subject: str, data: bytes | str) -> Heartbeat:
    return decode(Heartbeat, subject, data, protocol.heartbeat_subject, heartbeat_problem)


def decode_demand(subject: str, data: bytes | str) -> Demand:
    return decode(Demand, subject, data, protocol.demand_subject)


def decode_usage(subject: str, data: bytes | str) -> UsageRecord:
    return decode(UsageRecord, subject, data, protocol.usage_subject, usage_problem)


def decode_event(subject: str, data: bytes | str) -> Event:
    return decode(Event, subject, data, protocol.events_subject)


def decode_kv_batch(subject: str, data: bytes | str) -> KvCacheBatch:
    return decode(KvCacheBatch, subject, data, kv_events.kvcache_subject)


def decode_kv_resync(subject: str, data: bytes | str) -> KvResyncRequest:
    return decode(KvResyncRequest, subject, data, kv_events.kvresync_subject)
