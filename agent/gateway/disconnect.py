"""A client that leaves before its answer starts: the queue slot and the replica it held
are given back at once (a stream that already started cleans up itself)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol, runtime_checkable

from starlette.requests import Request
from starlette.responses import Response


@runtime_checkable
class Abandonable(Protocol):
    """A response that cleans up when it is dropped unsent (`stream.ProxiedStream`)."""

    async def abandon(self) -> None: ...


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work` (queueing, first attempt) but give up when the client disconnects, so a
    caller that went away neither holds a queue slot nor keeps a replica generating."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    try:
        response = await task
    except (asyncio.CancelledError, Exception):
        raise ClientGone() from None
    # finished in the same instant: drop it (its stream, if any, is never sent)
    if isinstance(response, Abandonable):
        await response.abandon()
    raise ClientGone()
