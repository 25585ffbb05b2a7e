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


def size_class(tokens: int) -> int:
    """Steps of similar size share estimates: a 2,000-token prefill and a 4-token decode do not."""
    return min(4, (max(1, tokens).bit_length() + 1) // 3)


@dataclass
class ThreadPolicy:
    """Chooses the thread count for each step from measured seconds per token.

    Per step-size class (`size_class`): the best known count, and every `probe_every` steps of
    that class `probe_steps` steps on each candidate. Estimates are exponential moving
    averages, so a change in the machine's load shows within a few probes.
    """

    max_threads: int
    probe_every: int = 64
    probe_steps: int = 3
    smoothing: float = 0.5
    estimates: dict[int, dict[int, float]] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)
    _plans: dict[int, list[int]] = field(default_factory=dict)

    @property
    def candidates(self) -> list[int]:
        if self.max_threads <= 1:
            return [1]
        return sorted({self.max_threads, max(1, self.max_threads // 2), 1}, reverse=True)

    def best(self, tokens: int = 1) -> int:
        est = self.estimates.get(size_class(tokens))
        if not est:
            return self.max_threads
        return min(est, key=lambda t: (est[t], -t))

    def next_threads(self, tokens: int = 1) -> int:
        """Thread count for the next step, which computes `tokens` tokens."""
        if len(self.candidates) == 1:
            return 1
        key = size_class(tokens)
        plan = self._plans.setdefault(key, [])
        seen = self._steps.get(key, 0)
        self._steps[key] = seen + 1
        known = self.estimates.get(key, {})
        if not plan and (seen % self.probe_every == 0 or len(known) < len(self.candidates)):
            plan.extend(t for t in self.candidates for _ in range(self.probe_steps))
        return plan.pop(0) if plan else self.best(tokens)

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """One finished step: how long it took with `threads` for `tokens` tokens."""
        if tokens <= 0 or seconds <= 0:
            return
        est = self.estimates.setdefault(size_class(tokens), {})
        per_token = seconds / tokens
        old = est.get(threads)
        est[threads] = per_token if old is None else old + self.smoothing * (per_token - old)


class ThreadTuner:
    """Applies a `ThreadPolicy` around each model step (`set_threads` is torch.set_num_threads)."""

    def __init__(self, policy: ThreadPolicy, set_threads: Callable[[int], None]) -> None:
        self.policy = policy
        self._set = set_threads
        self._current = 0

    def before_step(self, tokens: int) -> int:
        n = self.policy.next_threads(tokens)
        if n != self._current:
            self._set(n)
            self._current = n
        return n

    def after_step(self, seconds: float, tokens: int) -> None:
        self.policy.record(self._current, seconds, tokens)
