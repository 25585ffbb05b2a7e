"""Stopping child processes: graceful first, a bounded wait, then SIGKILL, always reaped.

A server we started should get SIGTERM so it can drain and clean up (flush a log, close
its store, hand streams over); one that ignores it must not hang the caller, so the wait
is bounded and SIGKILL follows. Waiting again after SIGKILL reaps it, so no zombie is
left behind and the exit code is known.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def stop_process(proc: subprocess.Popen[Any], timeout: float, *, group: bool = False) -> int:
    """SIGTERM `proc`, wait up to `timeout` s, else SIGKILL and wait; returns its exit code.

    `group=True` signals its process group instead (a child started with
    `start_new_session=True`, so what it started goes too). A child that has already
    exited is only reaped."""
    return stop_processes([proc], timeout, group=group)[0]


def stop_processes(
    procs: Sequence[subprocess.Popen[Any]], timeout: float, *, group: bool = False
) -> list[int]:
    """`stop_process` for several children: SIGTERM to all first, so they drain at the same
    time, then each gets up to `timeout` s before its SIGKILL. Exit codes in order."""
    for proc in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM, group)
    codes: list[int] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL, group)
            codes.append(proc.wait())
    return codes


def _signal(proc: subprocess.Popen[Any], sig: signal.Signals, group: bool) -> None:
    if not group:
        proc.send_signal(sig)  # a no-op once Popen knows it exited
        return
    with contextlib.suppress(ProcessLookupError):  # the whole group is already gone
        os.killpg(proc.pid, sig)
