"""The lifecycle every NATS-fed control loop repeats, in one place: background tasks,
core-NATS subscriptions made once per connection object on every (re)connect (nats-py
re-subscribes by itself after reconnects), and a stop that cancels the tasks and
unsubscribes. Lives outside `control_plane.loops` because `control_plane.rollouts.loop`
uses it and `control_plane.loops` imports that module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

Handler = Callable[[Any], Awaitable[None]]


class NatsLoop:
    """Base of a loop that owns tasks and subscriptions on `ctx.nats` (a NatsLink or None).
    Subclasses list their subscriptions in `_subscriptions` and may hook `_on_subscribed`
    (after a new connection's subscriptions) and `_on_connected` (after every connect)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self._subscribed_nc: object | None = None
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []

    def _subscriptions(self) -> list[tuple[str, Handler]]:
        """(subject, callback) pairs to subscribe on each new connection."""
        return []

    async def _on_subscribed(self) -> None:
        """Runs once per new connection object, after subscribing."""

    async def _on_connected(self) -> None:
        """Runs on every (re)connect, after any subscribing."""

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def _listen(self) -> None:
        """Register for (re)connects, and handle a connection made before we registered."""
        link = self.ctx.nats
        if link is not None:
            link.on_connect(self._on_connect)
            if link.is_connected:
                await self._on_connect()

    async def _on_connect(self) -> None:
        link = self.ctx.nats
        if link is None or link.nc is None:
            return
        if self._subscribed_nc is not link.nc:
            self._subscribed_nc = link.nc  # before awaiting: a concurrent call must not subscribe twice
            self._subs = [await link.nc.subscribe(subject, cb=cb) for subject, cb in self._subscriptions()]
            await self._on_subscribed()
        await self._on_connected()

    async def _tick(self, tick: Callable[[float], bool], log: logging.Logger, what: str) -> None:
        """One `tick(now)` in a thread; a True result (something changed) kicks reconcile.
        A failure is logged as "<what> failed", so the loop goes on."""
        try:
            if await asyncio.to_thread(tick, time.time()):
                self.ctx.kick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed", what)

    async def _close(self) -> None:
        """Stop hearing (re)connects, cancel the tasks, wait for them, and unsubscribe."""
        link = self.ctx.nats
        off_connect = getattr(link, "off_connect", None)
        if off_connect is not None:
            off_connect(self._on_connect)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
