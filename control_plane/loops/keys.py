"""Publishing `fleet_keys` on its own loop, apart from placement: a key created or
revoked reaches the gateways at once even while placement fails or is slow, and the key
set's lease (`api_keys.KEYS_LEASE`) is renewed every `key_lease_interval_s`, so agents
and gateways can tell a current key set from one nobody updates any more."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.context import ControlPlaneContext
from control_plane.fleet_model.snapshot import live_keys
from control_plane.loops.publish import KvPublisher
from fleet_base import api_keys, protocol

log = logging.getLogger(__name__)

LEASE_PERIODS = 3  # a lease promises renewal within this many intervals


class KeyLoop:
    def __init__(self, ctx: ControlPlaneContext) -> None:
        self.ctx = ctx
        self.publisher = (
            KvPublisher(ctx.nats, (protocol.BUCKET_KEYS,), ctx.epoch, on_newer_epoch=ctx.saw_epoch)
            if ctx.nats is not None
            else None
        )
        self.publishes = 0
        self._task: asyncio.Task[None] | None = None
        self._seen_nc: object | None = None

    async def start(self) -> KeyLoop:
        if self.publisher is not None:
            self._task = asyncio.create_task(self._run(), name="cp-keys")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def _wanted(self) -> dict[str, protocol.Message]:
        with self.ctx.sessions() as session:
            keys = live_keys(session)
        interval = self.ctx.settings.key_lease_interval_s
        wanted: dict[str, protocol.Message] = {k.key_id: k for k in keys}
        wanted[api_keys.KEYS_LEASE] = api_keys.KeyLease(
            issued_at=time.time(), valid_s=interval * LEASE_PERIODS, keys=len(keys)
        )
        return wanted

    async def publish_once(self) -> bool:
        assert self.publisher is not None
        link = self.ctx.nats
        if link is not None and link.nc is not self._seen_nc:  # a new connection: re-read the bucket
            self._seen_nc = link.nc
            self.publisher.invalidate()
        wanted = await asyncio.to_thread(self._wanted)
        ok = await self.publisher.publish({protocol.BUCKET_KEYS: wanted})
        self.publishes += ok
        return ok

    async def _run(self) -> None:
        interval = self.ctx.settings.key_lease_interval_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.keys_changed.wait(), interval)
            self.ctx.keys_changed.clear()
            try:
                await self.publish_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("publishing the key set failed; retrying")
                await asyncio.sleep(min(1.0, interval))


async def start_key_loop(ctx: ControlPlaneContext) -> KeyLoop:
    return await KeyLoop(ctx).start()
