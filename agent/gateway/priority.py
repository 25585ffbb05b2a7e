"""Which waiting request goes next when a slot frees: the gateway's queueing policy.

Classes are ranked (e.g. interactive before standard before batch); within a class the
order is FIFO. A waiter that has waited `max_age_s` or longer is overdue and goes before
every waiter that is not, oldest overdue first, so a lower class is never starved beyond
that age plus the time until the next slot frees (docs/quotas.md). Plain and synchronous.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

DEFAULT_CLASSES = ("interactive", "standard", "batch")
DEFAULT_CLASS = "standard"


@dataclass(eq=False)
class Waiter:
    seq: int
    klass: str
    arrived: float


@dataclass
class PriorityWaitlist:
    classes: tuple[str, ...] = DEFAULT_CLASSES
    max_age_s: float = 10.0
    _lists: dict[str, collections.deque[Waiter]] = field(default_factory=dict)
    _seq: int = 0

    def __post_init__(self) -> None:
        self._lists = {c: collections.deque() for c in self.classes}

    def klass(self, name: str | None, default: str = DEFAULT_CLASS) -> str:
        """A known class name: the given one, else the default, else the lowest class."""
        if name in self._lists:
            return name  # type: ignore[return-value]
        return default if default in self._lists else self.classes[-1]

    def add(self, klass: str, now: float) -> Waiter:
        self._seq += 1
        waiter = Waiter(self._seq, self.klass(klass), now)
        self._lists[waiter.klass].append(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        try:
            self._lists[waiter.klass].remove(waiter)
        except ValueError:
            pass

    def __len__(self) -> int:
        return sum(len(q) for q in self._lists.values())

    def depth(self, klass: str) -> int:
        return len(self._lists.get(klass, ()))

    def peek(self, now: float) -> Waiter | None:
        heads = [q[0] for q in self._lists.values() if q]
        if not heads:
            return None
        overdue = [w for w in heads if now - w.arrived >= self.max_age_s]
        if overdue:
            return min(overdue, key=lambda w: (w.arrived, w.seq))
        return heads[0]  # dict order is rank order

    def pop(self, now: float) -> Waiter | None:
        waiter = self.peek(now)
        if waiter is not None:
            self._lists[waiter.klass].popleft()
        return waiter
