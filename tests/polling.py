"""Polling for tests: wait until a condition holds, with a generous deadline, never a sleep
for ordering. `wait_for` blocks (threads, subprocess fleets); `eventually` awaits (tests
on the event loop; its check may be sync or async); `wait_for_process` waits for a child
process to become ready and fails at once, with its log, when it exits instead."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable
from typing import Any

Retry = bool | type[Exception] | tuple[type[Exception], ...]


def _retried(err: Exception, retry_errors: Retry) -> bool:
    if isinstance(retry_errors, bool):
        return retry_errors
    return isinstance(err, retry_errors)


def _probe(check: Callable[[], Any], retry_errors: Retry) -> Any:
    try:
        return check()
    except Exception as err:
        if not _retried(err, retry_errors):
            raise
        return err  # a component may be restarting: try again


class NotYet:
    """A check's "not yet" that says why: falsy, and shown in the timeout's message."""

    def __init__(self, detail: Any) -> None:
        self.detail = detail

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"not yet: {self.detail!r}"


def _done(value: Any) -> bool:
    return bool(value) and not isinstance(value, Exception)


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str = "condition",
    interval: float = 0.1,
    *,
    retry_errors: Retry = False,
) -> Any:
    """The first truthy value of `check()`; AssertionError with the last value at `timeout`.
    `retry_errors` (True, or the exception types) treats an exception from `check` as "not yet"."""
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
    retry_errors: Retry = False,
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
            if not _retried(err, retry_errors):
                raise
            last = err
        if _done(last):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


def wait_for_process(
    proc: subprocess.Popen,
    check: Callable[[], Any],
    timeout: float,
    what: str,
    log_tail: Callable[[], str] = lambda: "",
    interval: float = 0.05,
    *,
    retry_errors: Retry = OSError,
) -> Any:
    """`wait_for(check)` while `proc` runs: RuntimeError with `log_tail()` as soon as the
    process exits, or at `timeout` (the log says why a start-up failed)."""

    exited = object()

    def ready() -> Any:
        return exited if proc.poll() is not None else check()

    try:
        value = wait_for(ready, timeout, what, interval, retry_errors=retry_errors)
    except AssertionError as err:
        raise RuntimeError(f"{err}\n{log_tail()}") from None
    if value is exited:
        raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
    return value
