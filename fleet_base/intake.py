"""What a cluster may cost a reader of what it publishes, judged before the message is
parsed: its length, and a budget of messages and bytes per second per sender (the cluster
the subject `fleet.v1.<kind>.<cluster>` names: NATS lets only that cluster's identity
publish there). A cluster past its budget loses its own messages, nobody else's; parsing,
the expensive step (pure-Python validation on an event loop), is paid only for what fits.

Used by the gateway for KV events (`agent.gateway.prefix`) and by the control plane for
heartbeats and demand (`control_plane.inbox`). Pure and clock-injected; bounded in senders.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fleet_base.token_bucket import TokenBucket

MAX_SENDERS = 1024
BURST_S = 8.0  # a budget's burst: this many seconds' worth


@dataclass
class _Sender:
    messages: TokenBucket
    bytes: TokenBucket


class SenderBudget:
    """`admit(sender, size)`: True while the sender keeps within `messages_per_s` and
    `bytes_per_s`, each with `burst_s` seconds' worth of burst."""

    def __init__(
        self,
        messages_per_s: float,
        bytes_per_s: float,
        *,
        burst_s: float = BURST_S,
        max_senders: int = MAX_SENDERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.messages_per_s = messages_per_s
        self.bytes_per_s = bytes_per_s
        self.burst_s = burst_s
        self.max_senders = max_senders
        self.clock = clock
        self._senders: OrderedDict[str, _Sender] = OrderedDict()

    def admit(self, sender: str, size: int) -> bool:
        now = self.clock()
        s = self._senders.get(sender)
        if s is None:
            s = self._senders[sender] = _Sender(
                TokenBucket.full(self.messages_per_s * self.burst_s, self.burst_s, now),
                TokenBucket.full(self.bytes_per_s * self.burst_s, self.burst_s, now),
            )
            while len(self._senders) > self.max_senders:
                self._senders.popitem(last=False)
        self._senders.move_to_end(sender)
        if not (s.messages.fits(1, now) and s.bytes.fits(size, now)):
            return False
        s.messages.take(1, now)
        s.bytes.take(size, now)
        return True

    def __len__(self) -> int:
        return len(self._senders)


class Intake:
    """The cheap checks of one kind of message: `refusal(subject, data)` is None, or the
    reason to drop it unparsed: "size" (longer than `max_bytes`) or "rate" (its sender is
    past its budget)."""

    def __init__(
        self,
        max_bytes: int,
        messages_per_s: float,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.budget = SenderBudget(messages_per_s, bytes_per_s, clock=clock)

    def refusal(self, subject: str, data: bytes) -> str | None:
        if len(data) > self.max_bytes:
            return "size"
        if not self.budget.admit(subject.rsplit(".", 1)[-1], len(data)):
            return "rate"
        return None
