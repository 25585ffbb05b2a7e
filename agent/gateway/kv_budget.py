"""What each cluster may spend of a gateway's attention on its prefix-cache events: a
token bucket of messages and one of bytes per sender (the cluster a `fleet.v1.kvcache.<c>`
subject names: NATS lets only that cluster's agent publish there), judged on the
message's length alone, before it is parsed. A cluster over its budget loses its own
batches (its replicas drop out of this gateway's index until a resync), nobody else's.
Pure and clock-injected; bounded in senders."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agent.gateway.quota import TokenBucket

MAX_SENDERS = 1024


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
        burst_s: float = 8.0,
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
