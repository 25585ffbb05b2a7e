"""Durable JetStream ingestion: a pull consumer per stream, each batch handed to a
synchronous `store(batch) -> accepted` in a thread, messages acknowledged only after that
returns (the database committed). A batch that fails is not acknowledged: JetStream
redelivers it after `ack_wait_s`, and the store's unique message ids make the retry
idempotent. Messages the store rejects (poison) are terminated so they never come back.

Everything sent while the control plane was down waits in the stream and is read by the
same durable consumer when it returns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import FetchTimeoutError

log = logging.getLogger(__name__)

# Test hook: the process dies (like kill -9) right after receiving a batch ("received")
# or right after its commit, before any ack ("committed"). Only tests set it.
CRASH_ENV = "FLEET_TEST_INGEST_CRASH"


@dataclass(frozen=True)
class Received:
    """One message as the store sees it: the subject, the bytes, the stream sequence."""

    subject: str
    data: bytes
    seq: int


@dataclass
class Verdicts:
    """What the store made of a batch: indices of messages to terminate (poison)."""

    poison: set[int]


Store = Callable[[list[Received]], Verdicts]


class DurableConsumer:
    def __init__(
        self,
        link: Any,
        stream: str,
        subject: str,
        durable: str,
        store: Store,
        *,
        batch: int = 256,
        ack_wait_s: float = 10.0,
        retry_s: float = 1.0,
    ) -> None:
        self.link = link
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.store = store
        self.batch = batch
        self.ack_wait_s = ack_wait_s  # how long an unacknowledged batch waits (Settings.ingest_ack_wait_s)
        self.retry_s = retry_s
        self.stored = 0  # messages acknowledged after a commit

    async def run(self) -> None:
        """Forever: (re)bind to the durable consumer on each connection and drain it."""
        while True:
            try:
                await self.link.wait_connected()
                await self._drain()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("%s: consuming %s failed (%s); retrying", self.durable, self.stream, err)
                await asyncio.sleep(self.retry_s)

    async def _drain(self) -> None:
        nc = self.link.nc
        js = self.link.js
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_ack_pending=self.batch * 8,
        )
        sub = await js.pull_subscribe(self.subject, durable=self.durable, stream=self.stream, config=config)
        try:
            while self.link.nc is nc and self.link.is_connected:
                try:
                    msgs = await sub.fetch(self.batch, timeout=1.0)
                except (FetchTimeoutError, asyncio.TimeoutError):
                    continue
                if msgs:
                    await self._handle(msgs)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is gone with it
                pass

    async def _handle(self, msgs: list) -> None:
        batch = [Received(m.subject, m.data, _seq(m)) for m in msgs]
        crash = os.environ.get(CRASH_ENV)
        if crash == "received":
            os._exit(137)
        try:
            verdicts = await asyncio.to_thread(self.store, batch)
            if crash == "committed":
                os._exit(137)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: storing %d messages failed; they will be redelivered", self.durable, len(msgs))
            for m in msgs:
                await _quietly(m.nak(delay=self.retry_s))
            return
        for i, m in enumerate(msgs):
            await _quietly(m.term() if i in verdicts.poison else m.ack())
        self.stored += len(msgs) - len(verdicts.poison)


def _seq(msg: Any) -> int:
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:
        return 0


async def _quietly(awaitable: Any) -> None:
    """An ack lost with the connection is redelivered later, and stored once."""
    try:
        await awaitable
    except Exception as err:
        log.debug("ack failed: %s", err)
