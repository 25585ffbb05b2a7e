"""Reading a JetStream stream back from a point in time: an ordered (ephemeral) consumer
from `since` to what the stream held when it started. What a new leader or a restarted
control plane uses to rebuild the in-memory windows its predecessor had (a rollout step's
samples, the tokens refused within the quota-share window). Lives outside
`control_plane.loops` because `control_plane.rollouts.loop` uses it too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from fleet_base import protocol
from fleet_base.wire import Rejected, decode_usage

IDLE_S = 1.0  # a stream silent this long has nothing more to give


def start_time(since: float) -> str:
    return datetime.fromtimestamp(since, timezone.utc).isoformat().replace("+00:00", "Z")


async def replay(js: Any, stream: str, subject: str, since: float) -> AsyncIterator[Any]:
    """The stream's messages on `subject` stored at or after `since`, oldest first, up to
    the last one pending when the replay began."""
    sub = await js.subscribe(
        subject,
        stream=stream,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start_time(since)),
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=IDLE_S)
            except nats.errors.TimeoutError:
                return
            yield msg
            if msg.metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()


async def replay_usage(js: Any, since: float) -> AsyncIterator[tuple[protocol.UsageRecord | None, Any]]:
    """FLEET_USAGE from `since`: each record (None: one that does not decode, which the
    durable usage store counts) with its message's metadata."""
    async for msg in replay(js, protocol.STREAM_USAGE, protocol.USAGE_WILDCARD, since):
        try:
            usage = decode_usage(msg.subject, msg.data)
        except Rejected:
            usage = None
        yield usage, msg.metadata
