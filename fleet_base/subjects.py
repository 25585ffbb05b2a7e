"""Who may use which NATS subject: the one table that the code's publishes, subscriptions
and requests are checked against (`NatsLink(permits=...)`) and that nats-server's
per-identity permissions are generated from (`control_plane.security.nats_config`).

Because both sides read this table, a subject the code uses without a row here is refused
by the link itself (logged at warning, counted) in every test run, instead of being
refused silently by the server in production only. Each channel names its subject
function (`fleet_base.protocol`, `fleet_base.kv_events`) and, per role, whether that role
uses it for its own cluster only ("own") or for every cluster ("any").

KV reads are listed per role by bucket and key; they become the subjects nats-py actually
uses: `$JS.API.STREAM.INFO.KV_<bucket>` to bind, `$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`
to read one key (the key sits in the subject, so it can be permitted per key), and a core
subscription on `$KV.<bucket>.<key>` for updates (no consumer, whose filter would travel
in the payload where permissions cannot see it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from fleet_base import kv_events, protocol
from fleet_base.batch import names as batch
from fleet_base.security.identity import inbox_prefix

Scope = Literal["own", "any"]
ClusterRole = Literal["agent", "gateway"]
JS = "$JS.API"


@dataclass(frozen=True)
class Channel:
    """One kind of subject (`<prefix>.<kind>.<cluster>`) and who may use it."""

    name: str
    subject: Callable[[str], str]
    publish: Mapping[ClusterRole, Scope] = field(default_factory=dict)
    subscribe: Mapping[ClusterRole, Scope] = field(default_factory=dict)

    def pattern(self, scope: Scope, cluster: str) -> str:
        return self.subject(cluster if scope == "own" else "*")


CHANNELS: tuple[Channel, ...] = (
    Channel("heartbeat", protocol.heartbeat_subject, publish={"agent": "own"}, subscribe={"gateway": "any"}),
    Channel("events", protocol.events_subject, publish={"agent": "own"}),
    Channel("usage", protocol.usage_subject, publish={"gateway": "own"}),
    Channel("demand", protocol.demand_subject, publish={"gateway": "own"}),
    # prefix-cache contents: the agent relays its replicas', every gateway indexes them all
    Channel("kvcache", kv_events.kvcache_subject, publish={"agent": "own"}, subscribe={"gateway": "any"}),
    # a gateway that lost track asks the cluster's agent for its replicas' full sets
    Channel("kvresync", kv_events.kvresync_subject, publish={"gateway": "any"}, subscribe={"agent": "own"}),
    # `fleetctl models pull|rm`: requests from the control plane the agent answers
    Channel("models", protocol.models_subject, subscribe={"agent": "own"}),
)

# role -> (bucket, scope of the key): "own" = the key named after the cluster
KV_READS: Mapping[ClusterRole, tuple[tuple[str, Scope], ...]] = {
    "agent": (
        (protocol.BUCKET_DESIRED, "own"),
        (protocol.BUCKET_ROUTES, "any"),
        (protocol.BUCKET_KEYS, "any"),
    ),
    "gateway": (),
}

# roles that answer requests (allow_responses: only to the reply subject of a request received)
ANSWERS: frozenset[ClusterRole] = frozenset({"agent"})


def kv_read_subjects(bucket: str, key: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subjects to bind `bucket` and read `key` ('>' = every key)."""
    stream = f"KV_{bucket}"
    return (
        [f"{JS}.STREAM.INFO.{stream}", f"{JS}.DIRECT.GET.{stream}.$KV.{bucket}.{key}"],
        [f"$KV.{bucket}.{key}"],
    )


def batch_store_subjects() -> list[str]:
    """What `fleet_base.batch.nats_store` publishes to use its resources, and nothing else:
    every gateway runs any cluster's batch work, so none of it is scoped to a cluster. All
    deliveries (pull batches, ordered reads of keys and object chunks, API replies) come
    on the identity's own inbox.

    Per KV bucket: bind, read a key, write (put, create, compare-and-set, delete), and read
    a key range by an ephemeral pull consumer (`nats_io.kv_values`; filter in the payload:
    the buckets are the role's whole).
    The object store: bind, read an object's metadata, write chunks and metadata, purge an
    object's old chunks, read chunks by an ordered consumer. The work queue: publish items,
    count one parent's items, purge them (a cancelled batch's; the filter is in the
    payload, so the subject allows any purge of the stream: no more than pulling and
    acknowledging every item, which the role does anyway), and create, inspect, pull from
    and acknowledge the durable per-(deployment, priority) consumers, whose filter is in
    the create subject. The webhook queue: the same with its one consumer."""
    out: list[str] = []
    for bucket in (batch.BUCKET_FILES, batch.BUCKET_BATCHES, batch.BUCKET_RESULTS, batch.BUCKET_ASYNC):
        stream = f"KV_{bucket}"
        out += [
            f"{JS}.STREAM.INFO.{stream}",
            f"{JS}.DIRECT.GET.{stream}.$KV.{bucket}.>",
            f"$KV.{bucket}.>",
            f"{JS}.CONSUMER.CREATE.{stream}",
            f"{JS}.CONSUMER.INFO.{stream}.*",
            f"{JS}.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.FC.{stream}.>",
        ]
    obj = f"OBJ_{batch.OBJECT_BUCKET_FILES}"
    out += [
        f"{JS}.STREAM.INFO.{obj}",
        f"{JS}.STREAM.MSG.GET.{obj}",
        f"$O.{batch.OBJECT_BUCKET_FILES}.>",
        f"{JS}.STREAM.PURGE.{obj}",
        f"{JS}.CONSUMER.CREATE.{obj}",
        f"{JS}.CONSUMER.INFO.{obj}.*",
        f"$JS.FC.{obj}.>",
    ]
    work = batch.STREAM_WORK
    out += [
        f"{batch.WORK_SUBJECT_PREFIX}.>",
        f"{JS}.STREAM.INFO.{work}",
        f"{JS}.STREAM.PURGE.{work}",  # names.parent_filter in the payload
        f"{JS}.CONSUMER.CREATE.{work}.*.{batch.WORK_SUBJECT_PREFIX}.*.*.*",  # names.work_filter
        f"{JS}.CONSUMER.INFO.{work}.*",
        f"{JS}.CONSUMER.MSG.NEXT.{work}.*",
        f"$JS.ACK.{work}.>",
    ]
    hooks, consumer = batch.STREAM_WEBHOOKS, batch.WEBHOOK_CONSUMER
    out += [
        batch.WEBHOOK_SUBJECT,
        f"{JS}.CONSUMER.CREATE.{hooks}.{consumer}.{batch.WEBHOOK_SUBJECT}",
        f"{JS}.CONSUMER.INFO.{hooks}.{consumer}",
        f"{JS}.CONSUMER.MSG.NEXT.{hooks}.{consumer}",
        f"$JS.ACK.{hooks}.{consumer}.>",
    ]
    return out


# roles that run batch and async inference's store
BATCH_STORE: frozenset[ClusterRole] = frozenset({"gateway"})


def allowed(role: ClusterRole, cluster: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subjects the `role` of `cluster` may use, in table order."""
    pub = [c.pattern(c.publish[role], cluster) for c in CHANNELS if role in c.publish]
    sub = [f"{inbox_prefix(role, cluster)}.>"]
    sub += [c.pattern(c.subscribe[role], cluster) for c in CHANNELS if role in c.subscribe]
    for bucket, scope in KV_READS[role]:
        p, s = kv_read_subjects(bucket, cluster if scope == "own" else ">")
        pub += p
        sub += s
    if role in BATCH_STORE:
        pub += batch_store_subjects()
    return pub, sub


def permissions(role: ClusterRole, cluster: str) -> dict:
    """The nats-server `permissions` block of one cluster identity."""
    pub, sub = allowed(role, cluster)
    out: dict = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if role in ANSWERS:
        out["allow_responses"] = {"max": 1}
    return out


def covers(allow: str, subject: str) -> bool:
    """Whether the permission `allow` admits `subject` (itself possibly a wildcard
    subscription), by NATS token rules: `*` one token, `>` the rest."""
    a, s = allow.split("."), subject.split(".")
    for i, token in enumerate(a):
        if token == ">":
            return i < len(s)
        if i >= len(s) or s[i] == ">" or (token != "*" and (token != s[i] or s[i] == "*")):
            return False
    return len(a) == len(s)


@dataclass(frozen=True)
class Permits:
    """What one identity may use, as the server will judge it; None on a link: anything."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def may(self, op: Literal["publish", "subscribe"], subject: str) -> bool:
        return any(covers(a, subject) for a in (self.publish if op == "publish" else self.subscribe))


def permits(role: ClusterRole, cluster: str) -> Permits:
    pub, sub = allowed(role, cluster)
    return Permits(tuple(pub), tuple(sub))
