"""Polling for tests: wait until a condition holds, with a generous deadline, never a sleep
for ordering. `wait_for` blocks (threads, subprocess fleets); `eventually` awaits (tests
on the event loop; its check may be sync or async)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _probe(check: Callable[[], Any], retry_errors: bool) -> Any:
    try:
        return check()
    except Exception as err:
        if not retry_errors:
            raise
        return err  # a component may be restarting: try again


def _done(value: Any) -> bool:
    return bool(value) and not isinstance(value, Exception)


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str = "condition",
    interval: float = 0.1,
    *,
    retry_errors: bool = False,
) -> Any:
    """The first truthy value of `check()`; AssertionError with the last value at `timeout`.
    `retry_errors` treats an exception from `check` as "not yet"."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = _probe(check, retry_errors)
        if _done(last):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval)


async def eventually(
    check: Callable[[], Any],
    timeout: float = 15.0,
    what: str = "condition",
    interval: float = 0.05,
    *,
    retry_errors: bool = False,
) -> Any:
    """`wait_for` on the event loop: `check` may return a value or an awaitable."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if inspect.isawaitable(last):
                last = await last
        except Exception as err:
            if not retry_errors:
                raise
            last = err
        if _done(last):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)
