"""Which waiting request goes next when a slot frees: the gateway's queueing policy.

Classes are ranked (e.g. interactive before standard before batch). Within a class, keys
take turns (round robin): each key's own requests are FIFO, and a key that was just served
goes behind every other key waiting in the class, so a key that floods the queue delays
another key's request by at most one of its own per request of the other key ahead of it
(docs/quotas.md). A key may be passed over while it is not `eligible` (at its
`max_concurrent`); it keeps its turn.

A class whose oldest eligible waiter has waited `max_age_s` or longer is overdue and goes
before every class that is not, the oldest overdue first, so a lower class is never
starved beyond that age plus the time until the next slot frees. The `batch` class never
becomes overdue (`unaged`): it runs only in capacity nobody else waits for, so it can never
overtake an interactive or standard waiter, however long it waited. Plain and synchronous.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fleet_base.openai_contract.priority import BATCH_CLASS

DEFAULT_CLASSES = ("interactive", "standard", "batch")
DEFAULT_CLASS = "standard"


def _anyone(key: str) -> bool:
    return True


@dataclass(eq=False)
class Waiter:
    seq: int
    klass: str
    arrived: float
    key: str = ""


@dataclass
class PriorityWaitlist:
    classes: tuple[str, ...] = DEFAULT_CLASSES
    max_age_s: float = 10.0
    unaged: frozenset[str] = frozenset({BATCH_CLASS})  # classes that never become overdue
    # class -> key -> that key's waiters (FIFO); a class's key order is its rotation
    _lists: dict[str, dict[str, collections.deque[Waiter]]] = field(default_factory=dict)
    _per_key: collections.Counter[str] = field(default_factory=collections.Counter)
    _seq: int = 0

    def __post_init__(self) -> None:
        self._lists = {c: {} for c in self.classes}

    def klass(self, name: str | None, default: str = DEFAULT_CLASS) -> str:
        """A known class name: the given one, else the default, else the lowest class."""
        if name in self._lists:
            return name  # type: ignore[return-value]
        return default if default in self._lists else self.classes[-1]

    def add(self, klass: str, now: float, key: str = "") -> Waiter:
        self._seq += 1
        waiter = Waiter(self._seq, self.klass(klass), now, key)
        self._lists[waiter.klass].setdefault(key, collections.deque()).append(waiter)
        self._per_key[key] += 1
        return waiter

    def remove(self, waiter: Waiter) -> None:
        keys = self._lists[waiter.klass]
        line = keys.get(waiter.key)
        if line is None or waiter not in line:
            return
        line.remove(waiter)
        if not line:
            del keys[waiter.key]
        self._per_key[waiter.key] -= 1
        if not self._per_key[waiter.key]:
            del self._per_key[waiter.key]

    def __len__(self) -> int:
        return sum(self._per_key.values())

    def __iter__(self) -> Iterator[Waiter]:
        for keys in self._lists.values():
            for line in keys.values():
                yield from line

    def depth(self, klass: str) -> int:
        return sum(len(line) for line in self._lists.get(klass, {}).values())

    def of_key(self, key: str) -> int:
        """Requests of `key` waiting here."""
        return self._per_key.get(key, 0)

    def peek(self, now: float, eligible: Callable[[str], bool] = _anyone) -> Waiter | None:
        best: str | None = None  # the first class with an eligible waiter
        oldest: Waiter | None = None  # the oldest overdue eligible waiter
        for klass, keys in self._lists.items():
            heads = [line[0] for key, line in keys.items() if eligible(key)]
            if not heads:
                continue
            best = best or klass
            first = min(heads, key=lambda w: (w.arrived, w.seq))
            if (
                klass not in self.unaged
                and now - first.arrived >= self.max_age_s
                and (oldest is None or (first.arrived, first.seq) < (oldest.arrived, oldest.seq))
            ):
                oldest = first
        klass = oldest.klass if oldest is not None else best
        if klass is None:
            return None
        return next(line[0] for key, line in self._lists[klass].items() if eligible(key))

    def pop(self, now: float, eligible: Callable[[str], bool] = _anyone) -> Waiter | None:
        waiter = self.peek(now, eligible)
        if waiter is not None:
            self.remove(waiter)
            keys = self._lists[waiter.klass]
            if waiter.key in keys:  # served: its next request goes behind the other keys
                keys[waiter.key] = keys.pop(waiter.key)
        return waiter
