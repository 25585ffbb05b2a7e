"""NATS at the edge: a connection that survives NATS restarts, the JetStream buckets and
streams of the wire contract, and a KV watcher that re-subscribes after reconnects.

Used by the agent, the gateway and the control plane alike. Everything above this
module deals in `fleet_base.protocol` models and never sees a NATS error: while NATS is
down, publishes are dropped (heartbeats are periodic, desired state is republished on
reconnect) and callers keep acting on their last known state.

Slightly over ~400 lines: the connection, the buckets and streams, and the KV watcher
share one reconnect story and are read together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, KeyValueConfig, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from fleet_base import protocol
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.jetstream_budget import JetStreamBudget
from fleet_base.security.tls import NatsTls
from fleet_base.subjects import Permits

log = logging.getLogger(__name__)

OnConnect = Callable[[], Awaitable[None]]
Responder = Callable[[bytes], Awaitable[protocol.Message]]


class KvConflict(Exception):
    """A compare-and-set write to a KV key lost: the key moved past the expected revision."""


class NatsLink:
    """One long-lived NATS connection with backoff on the first connect as well as on
    reconnects (nats-py only retries after a first success). `on_connect` callbacks run
    after every (re)connect: the place to republish state and re-create watchers.

    With `permits` (`fleet_base.subjects.permits(role, cluster)`), a publish, request or
    subscription outside the identity's table is refused here, before the server would;
    either refusal is logged at warning and counted in `refused` (by "publish"/"subscribe")."""

    def __init__(
        self,
        url: str,
        name: str,
        *,
        max_backoff_s: float = 5.0,
        tls: NatsTls | None = None,
        manage_jetstream: bool = True,
        permits: Permits | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.max_backoff_s = max_backoff_s
        # TLS with this identity's certificate; None: plaintext and anonymous (tests only).
        self.tls = tls
        # Create missing buckets and streams on connect: only the control plane may.
        self.manage_jetstream = manage_jetstream
        self.permits = permits
        self.refused: collections.Counter[str] = collections.Counter()
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.connected = asyncio.Event()
        self._on_connect: list[OnConnect] = []
        self._task: asyncio.Task | None = None
        self._closing = False
        self._kv: dict[str, KeyValue] = {}
        self._responders: dict[str, Responder] = {}
        self._answering: set[tuple[int, str]] = set()  # (connection, subject) subscribed

    def respond(self, subject: str, handler: Responder) -> None:
        """Answer requests on `subject` with `handler(request bytes) -> reply`, from now on
        and after every reconnect."""
        self._responders[subject] = handler
        if self.is_connected:
            asyncio.get_running_loop().create_task(self._subscribe_responders())

    async def _subscribe_responders(self) -> None:
        nc = self.nc
        if nc is None:
            return
        for subject, handler in self._responders.items():
            if (id(nc), subject) in self._answering:
                continue
            self._answering.add((id(nc), subject))

            async def answer(msg, handler=handler) -> None:
                try:
                    reply = await handler(msg.data)
                except Exception:
                    log.exception("answering %s failed", msg.subject)
                    return
                if msg.reply:
                    with contextlib.suppress(Exception):
                        await msg.respond(reply.to_bytes())

            await self.subscribe(subject, answer)

    def allows(self, op: str, subject: str) -> bool:
        """Whether this identity's table admits `op` ("publish"/"subscribe") on `subject`;
        a refusal is logged at warning and counted."""
        if self.permits is None or self.permits.may(op, subject):  # type: ignore[arg-type]
            return True
        self.refused[op] += 1
        log.warning("%s on %s refused: not in this identity's subject table", op, subject)
        return False

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        """A core subscription on the current connection, or None when not permitted."""
        if not self.allows("subscribe", subject):
            return None
        assert self.nc is not None
        return await self.nc.subscribe(subject, cb=cb)

    async def request(self, subject: str, message: protocol.Message, timeout: float = 5.0) -> bytes | None:
        """One request/reply; None when NATS is down or nobody answered in time."""
        if not self.is_connected or not self.allows("publish", subject):
            return None
        try:
            msg = await self.nc.request(subject, message.to_bytes(), timeout=timeout)
        except Exception as err:
            log.debug("request %s failed: %s", subject, err)
            return None
        return msg.data

    def on_connect(self, callback: OnConnect) -> None:
        self._on_connect.append(callback)

    def off_connect(self, callback: OnConnect) -> None:
        """Forget a callback `on_connect` registered (a stopped loop must not be called again)."""
        with contextlib.suppress(ValueError):
            self._on_connect.remove(callback)

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._connect_loop(), name=f"nats-connect-{self.name}")

    async def wait_connected(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self.connected.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _connect_loop(self) -> None:
        delay = 0.2
        secure: dict = {}
        if self.tls is not None:
            secure = {"tls": self.tls.context(), "inbox_prefix": self.tls.inbox_prefix}
        while not self._closing:
            try:
                nc = await nats.connect(
                    self.url,
                    name=self.name,
                    **secure,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                    disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                    error_cb=self._error,
                )
            except Exception as err:  # nats raises several unrelated types on refusal
                log.info(
                    "nats %s unreachable (%s: %s); retrying in %.1fs",
                    redact_url(self.url),
                    type(err).__name__,
                    str(err)[:200],
                    delay,
                )
                await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))
                delay = min(self.max_backoff_s, delay * 2)
                continue
            self.nc = nc
            self.js = nc.jetstream()
            await self._after_connect()
            return

    async def _after_connect(self) -> None:
        self._kv.clear()
        if self.manage_jetstream:
            try:
                await ensure_jetstream(self.js)
            except Exception as err:
                log.warning("could not set up JetStream buckets: %s", err)
        self.connected.set()
        try:
            await self._subscribe_responders()
        except Exception as err:
            log.warning("could not subscribe responders: %s", err)
        for callback in list(self._on_connect):
            try:
                await callback()
            except Exception:
                log.exception("nats on_connect callback failed")

    async def _disconnected(self) -> None:
        if not self._closing:
            log.warning("nats disconnected from %s", redact_url(self.url))
        self.connected.clear()

    async def _reconnected(self) -> None:
        log.info("nats reconnected to %s", redact_url(self.url))
        await self._after_connect()

    async def _error(self, err: Exception) -> None:
        text = str(err)
        if "permissions violation" in text.lower():  # the server refused a subject: never silent
            op = "subscribe" if "subscription" in text.lower() else "publish"
            self.refused[op] += 1
            log.warning("nats refused a %s (%s): the server's permissions and the code disagree", op, text)
            return
        log.debug("nats error: %s", err)

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            assert self.js is not None
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def kv_put(self, bucket: str, key: str, message: protocol.Message) -> bool:
        """Best effort: False (not an exception) while NATS is down."""
        if not self.is_connected:
            return False
        try:
            await (await self.kv(bucket)).put(key, message.to_bytes())
            return True
        except Exception as err:
            log.warning("kv put %s/%s failed: %s", bucket, key, err)
            return False

    async def kv_delete(self, bucket: str, key: str) -> bool:
        if not self.is_connected:
            return False
        try:
            await (await self.kv(bucket)).delete(key)
            return True
        except Exception as err:
            log.warning("kv delete %s/%s failed: %s", bucket, key, err)
            return False

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        if not self.is_connected:
            return None
        try:
            entry = await (await self.kv(bucket)).get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        return entry.value

    async def kv_items(self, bucket: str) -> dict[str, bytes]:
        """Every live key of a bucket (used for resyncs)."""
        return (await self.kv_snapshot(bucket))[0]

    async def kv_snapshot(self, bucket: str) -> tuple[dict[str, bytes], int]:
        """Every live key of a bucket and the bucket stream's last sequence (`kv_revisions`
        without the revisions)."""
        entries, last_seq = await self.kv_revisions(bucket)
        return {key: value for key, (value, _) in entries.items()}, last_seq

    async def kv_revisions(self, bucket: str) -> tuple[dict[str, tuple[bytes, int]], int]:
        """Every live key of a bucket with its value and revision, and the bucket stream's
        last sequence.

        Lists subjects from the bucket stream's info, not nats-py's `KeyValue.keys()`,
        whose watcher can report "no keys" for a bucket that has some (its end-of-data
        marker may arrive before the first entry): a resync would then "delete" them."""
        assert self.js is not None
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        kv = await self.kv(bucket)
        out: dict[str, tuple[bytes, int]] = {}
        for subject in sorted(info.state.subjects or {}):
            key = subject[len(prefix) :]
            try:
                entry = await kv.get(key)
            except NotFoundError:  # deleted or purged (KeyDeletedError, KeyNotFoundError)
                continue
            if entry.value is not None:
                out[key] = (entry.value, int(entry.revision or 0))
        return out, int(info.state.last_seq or 0)

    async def kv_last_seq(self, bucket: str) -> int:
        """The bucket stream's last sequence: it moved when anyone wrote or deleted a key."""
        assert self.js is not None
        info = await self.js.stream_info(f"KV_{bucket}")
        return int(info.state.last_seq or 0)

    async def kv_entry(self, bucket: str, key: str) -> tuple[bytes | None, int]:
        """A key's value (None: deleted or never written) and its revision (that of its
        delete marker; 0 when the bucket holds nothing under it)."""
        try:
            entry = await (await self.kv(bucket)).get(key)
        except NotFoundError as err:  # a delete marker's revision rides on the error (nats-py)
            return None, int(getattr(getattr(err, "entry", None), "revision", 0) or 0)
        return entry.value, int(entry.revision or 0)

    async def kv_cas(self, bucket: str, key: str, value: bytes | None, last: int) -> int:
        """Write `value` (None: a delete marker) under `key` only if the key's latest
        revision is `last` (0: the key holds nothing); the new revision. Raises
        `KvConflict` when someone else wrote the key since."""
        assert self.js is not None
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last)}
        if value is None:
            headers["KV-Operation"] = "DEL"
        try:
            ack = await self.js.publish(f"$KV.{bucket}.{key}", value or b"", headers=headers)
        except APIError as err:
            if err.err_code in (10071, 10164):  # wrong last sequence
                raise KvConflict(f"{bucket}/{key} moved past revision {last}") from err
            raise
        return int(ack.seq)

    async def publish(self, subject: str, message: protocol.Message) -> bool:
        if not self.is_connected or not self.allows("publish", subject):
            return False
        try:
            await self.nc.publish(subject, message.to_bytes())
            return True
        except Exception as err:
            log.debug("publish %s failed: %s", subject, err)
            return False

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 2)
        self.connected.clear()


KV_VALUES_BATCH = 512  # messages per pull while reading a key range


async def kv_values(js: JetStreamContext, bucket: str, keys: str = ">") -> list[tuple[str, bytes, int]]:
    """Every live (key, value, revision) of a bucket under a key pattern, in one pass, each
    key once with the latest value the read saw.

    Read by an ephemeral pull consumer. A pull consumer delivers nothing before it is asked,
    so its pending count, taken at creation, is exact: nats-py's `KeyValue.watch` reads that
    count after the server has started pushing, and can report "caught up" before entries it
    already holds, so a full range could read as empty. Writes made during the read are
    delivered too (a key overwritten before its turn comes back at its new sequence), so the
    read goes on past the stream's last sequence at its start until nothing is pending, but
    for at most as many messages again as it began with: writers that never stop cannot keep
    it going (a key they overwrite then may be missing). For a bucket the caller may only
    `get` from, `NatsLink.kv_revisions` lists subjects instead."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    end = int((await js.stream_info(stream)).state.last_seq or 0)
    config = ConsumerConfig(
        filter_subject=prefix + keys,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=10.0,  # the server removes it once no pull is waiting on it
    )
    # Created unnamed (`CONSUMER.CREATE.<stream>`, the subject roles are permitted), then bound.
    info = await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(info.name, stream=stream)
    latest: dict[str, tuple[bytes | None, int]] = {}
    left, extra = info.num_pending, max(info.num_pending, KV_VALUES_BATCH)
    try:
        while left > 0 and extra > 0:
            try:
                msgs = await sub.fetch(min(left, KV_VALUES_BATCH), timeout=5.0)
            except asyncio.TimeoutError:  # nats-py's own subclasses it: what was pending went away
                break
            for msg in msgs:
                meta = msg.metadata
                seq = int(meta.sequence.stream)
                left = meta.num_pending
                extra -= seq > end
                headers = msg.headers or {}
                marker = headers.get("KV-Operation") or headers.get("Nats-Marker-Reason")
                latest[msg.subject[len(prefix) :]] = (None if marker else msg.data, seq)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return [(key, value, seq) for key, (value, seq) in latest.items() if value is not None]


def redact_url(url: str) -> str:
    """A NATS URL (or comma-separated list) without user:password or token."""
    parsed = []
    for part in url.split(","):
        scheme, sep, rest = part.strip().partition("://")
        if not sep:
            scheme, rest = "", scheme
        host = rest.rsplit("@", 1)[-1]
        masked = "***@" if "@" in rest else ""
        parsed.append(f"{scheme}{sep}{masked}{host}")
    return ",".join(parsed)


async def ensure_jetstream(js: JetStreamContext, budget: JetStreamBudget | None = None) -> None:
    """Create the contract's KV buckets and streams (batch and async inference's too:
    `fleet_base.batch.resources`) if missing, and bring the limits of existing ones to the
    budget (idempotent). Buckets allow direct get, so a single key's
    read is one subject a NATS user can be permitted. Every stream gets `max_bytes`, which
    nats-server reserves: see `fleet_base.jetstream_budget`."""
    budget = budget or JetStreamBudget.from_env()
    for bucket in protocol.BUCKETS:
        limits = budget.limits(f"KV_{bucket}")
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, direct=True, max_bytes=limits.max_bytes)
            )
            continue
        info = await js.stream_info(f"KV_{bucket}")
        if not info.config.allow_direct or info.config.max_bytes != limits.max_bytes:
            info.config.allow_direct = True
            info.config.max_bytes = limits.max_bytes
            await js.update_stream(info.config)
    for name, subjects in (
        (protocol.STREAM_EVENTS, [protocol.EVENTS_WILDCARD]),
        (protocol.STREAM_USAGE, [protocol.USAGE_WILDCARD]),
    ):
        limits = budget.limits(name)
        wanted = {
            "max_bytes": limits.max_bytes,
            "max_msg_size": limits.max_msg_size,
            "max_msgs_per_subject": limits.max_msgs_per_subject,
            "max_age": limits.max_age_s,
            "discard": DiscardPolicy.OLD,
        }
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(StreamConfig(name=name, subjects=subjects, **wanted))
            continue
        config = info.config
        if any(getattr(config, k) != v for k, v in wanted.items()):
            for k, v in wanted.items():
                setattr(config, k, v)
            await js.update_stream(config)
    await ensure_batch_resources(js, budget)


KvCallback = Callable[[str, bytes | None], Awaitable[None]]


class RetryLater(Exception):
    """Raised by a KvWatch callback that took note of a value but could not finish acting
    on it (its write to a full disk failed): delivered again at the next resync, and
    logged without a traceback (the callback reported why)."""


class KvWatch:
    """Follow keys of a bucket across NATS restarts: a watcher per connection, plus a
    full resync on every (re)connect and every `resync_s`, so a missed update is
    repaired within that time. The callback gets (key, value) and (key, None) on delete.

    A value counts as seen only once every callback took it without raising: a callback
    that could not act on it (its write to a full disk failed) gets it again at the next
    resync, so nothing is lost to a failure. Callbacks must therefore be idempotent."""

    def __init__(self, link: NatsLink, bucket: str, keys: str = ">", resync_s: float = 10.0) -> None:
        self.link = link
        self.bucket = bucket
        self.keys = keys
        self.resync_s = resync_s
        self._callbacks: list[KvCallback] = []
        self._task: asyncio.Task | None = None
        self._seen: dict[str, bytes] = {}
        self._failing: set[str] = set()  # keys whose last delivery a callback refused
        link.on_connect(self._restart)

    def subscribe(self, callback: KvCallback) -> None:
        self._callbacks.append(callback)

    async def _restart(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._run(), name=f"kv-watch-{self.bucket}")

    async def _emit(self, key: str, value: bytes | None) -> None:
        if (key not in self._seen) if value is None else (self._seen.get(key) == value):
            return
        failed = False
        for callback in self._callbacks:
            try:
                await callback(key, value)
            except RetryLater as err:
                failed = True
                if key not in self._failing:
                    log.warning("kv watch %s/%s: %s; delivering it again", self.bucket, key, err)
            except Exception:
                failed = True
                if key in self._failing:  # the same failure again: already logged
                    log.debug("kv watch callback failed again for %s/%s", self.bucket, key, exc_info=True)
                else:
                    log.exception("kv watch callback failed for %s/%s; retrying", self.bucket, key)
        if failed:  # not seen: the next resync delivers it again
            self._failing.add(key)
            return
        self._failing.discard(key)
        if value is None:
            self._seen.pop(key, None)
        else:
            self._seen[key] = value

    async def resync(self) -> None:
        if not self.link.is_connected:  # "no answer" is not "no key": never emit deletes for it
            raise ConnectionError(f"resync of {self.bucket} while NATS is down")
        if _is_single_key(self.keys):  # one key: a direct get, never a listing of the bucket
            value = await self.link.kv_get(self.bucket, self.keys)
            if value is None and not self.link.is_connected:
                raise ConnectionError(f"NATS went down during the resync of {self.bucket}")
            items = {} if value is None else {self.keys: value}
        else:
            items = await self.link.kv_items(self.bucket)
            if self.keys != ">":
                items = {k: v for k, v in items.items() if _matches(self.keys, k)}
        for key in list(self._seen):
            if key not in items:
                await self._emit(key, None)
        for key, value in items.items():
            await self._emit(key, value)

    async def _run(self) -> None:
        """Updates arrive on a core subscription to the bucket's subjects (`$KV.<bucket>.<keys>`):
        a KV put is a publish there, and a NATS user can be allowed exactly those subjects,
        unlike a consumer, whose filter travels in the request payload."""
        prefix = f"$KV.{self.bucket}."
        while True:
            sub = None
            try:
                assert self.link.nc is not None
                updates: asyncio.Queue = asyncio.Queue()
                sub = await self.link.subscribe(prefix + self.keys, updates.put)
                await self.link.nc.flush(timeout=5)
                loop = asyncio.get_running_loop()
                while True:
                    await self.resync()
                    deadline = loop.time() + self.resync_s
                    while (timeout := deadline - loop.time()) > 0:
                        try:
                            msg = await asyncio.wait_for(updates.get(), timeout)
                        except asyncio.TimeoutError:
                            break
                        key = msg.subject[len(prefix) :]
                        operation = (msg.headers or {}).get("KV-Operation", "")
                        deleted = operation in ("DEL", "PURGE") or not msg.data
                        await self._emit(key, None if deleted else msg.data)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.debug("kv watch %s interrupted: %s", self.bucket, err)
                await asyncio.sleep(1.0)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def _is_single_key(pattern: str) -> bool:
    return not any(token in ("*", ">") for token in pattern.split("."))


def _matches(pattern: str, key: str) -> bool:
    p, k = pattern.split("."), key.split(".")
    for i, part in enumerate(p):
        if part == ">":
            return True
        if i >= len(k) or (part != "*" and part != k[i]):
            return False
    return len(p) == len(k)
