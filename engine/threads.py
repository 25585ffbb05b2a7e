"""How many intra-op threads torch uses, chosen by the cores this process may actually get.

Two things go wrong on a shared CPU. torch's default counts every core of the machine, not the
ones this process is allowed (affinity, cgroup quota). And when another process competes for
the cores, every multi-threaded op waits at its barrier for its slowest thread to be scheduled:
a decode step of a small model is thousands of short ops, so its time can grow many-fold while
a single-threaded loop (or transformers' fewer, larger ops) barely moves. `ThreadPolicy` is
the pure decision: it keeps the thread count whose measured seconds per token is lowest and
re-probes the others now and then, so the engine follows the machine's load as it changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


@dataclass
class ThreadPolicy:
    """Chooses the thread count for each step from measured seconds per token.

    Steps alternate between exploiting the best known count and, every `probe_every` steps,
    `probe_steps` steps on each other candidate. Estimates are exponential moving averages, so
    a change in the machine's load shows within a few probes.
    """

    max_threads: int
    probe_every: int = 64
    probe_steps: int = 3
    smoothing: float = 0.5
    estimates: dict[int, float] = field(default_factory=dict)
    _step: int = 0
    _plan: list[int] = field(default_factory=list)

    @property
    def candidates(self) -> list[int]:
        if self.max_threads <= 1:
            return [1]
        half = max(1, self.max_threads // 2)
        return sorted({self.max_threads, half, 1}, reverse=True)

    @property
    def best(self) -> int:
        if not self.estimates:
            return self.max_threads
        return min(self.estimates, key=lambda t: (self.estimates[t], -t))

    def next_threads(self) -> int:
        """Thread count for the next step."""
        if len(self.candidates) == 1:
            return 1
        if not self._plan and (
            self._step % self.probe_every == 0 or len(self.estimates) < len(self.candidates)
        ):
            self._plan = [t for t in self.candidates for _ in range(self.probe_steps)]
        self._step += 1
        return self._plan.pop(0) if self._plan else self.best

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """One finished step: how long it took with `threads` for `tokens` tokens."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        old = self.estimates.get(threads)
        self.estimates[threads] = per_token if old is None else old + self.smoothing * (per_token - old)


class ThreadTuner:
    """Applies a `ThreadPolicy` around each model step (`set_threads` is torch.set_num_threads)."""

    def __init__(self, policy: ThreadPolicy, set_threads: Callable[[int], None]) -> None:
        self.policy = policy
        self._set = set_threads
        self._current = 0

    def before_step(self) -> int:
        n = self.policy.next_threads()
        if n != self._current:
            self._set(n)
            self._current = n
        return n

    def after_step(self, seconds: float, tokens: int) -> None:
        self.policy.record(self._current, seconds, tokens)
