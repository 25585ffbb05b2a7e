"""How old the gateway's key set is, and what it does once it is too old to trust for
revocations (`gateway.stale_keys`, docs/security.md).

The age is the time since the agent last heard the control plane renew the key set's
lease (`keys-lease.json`; without a lease ever seen, since keys.json was written).
While the age is within `key_state_max_age_s`, keys are judged by the key set alone and
a revocation arrives within a couple of seconds. Past it (agent dead, NATS or control plane
unreachable), a revocation may have been missed:
- "verified": keep serving only keys this gateway verified while the set was fresh; a key
  it never saw is refused (it may be new, or revoked, or forged: nobody can tell).
  Availability for known users; a key revoked during the outage keeps working until
  the state is fresh again.
- "refuse": refuse every key until the state is fresh again. Revocation never fails
  open; an outage of the control plane or NATS longer than the bound stops all traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from agent.gateway.errors import GatewayError
from fleet_base.api_keys import ApiKeyRecord

StaleMode = Literal["verified", "refuse"]


class KeyFreshness:
    def __init__(
        self,
        confirmed_at: Callable[[], float | None],
        max_age_s: float,
        mode: StaleMode = "verified",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.confirmed_at = confirmed_at
        self.max_age_s = max_age_s
        self.mode = mode
        self.clock = clock
        self._verified: dict[str, tuple[str, str]] = {}  # key id -> (salt, hash) verified while fresh

    def age_s(self) -> float | None:
        at = self.confirmed_at()
        return None if at is None else max(0.0, self.clock() - at)

    def stale(self) -> bool:
        age = self.age_s()
        return age is None or age > self.max_age_s

    def admit(self, record: ApiKeyRecord) -> None:
        """After the secret checked out: remember it while fresh, apply the mode when stale."""
        if not self.stale():
            self._verified[record.key_id] = (record.salt, record.hash)
            return
        if self.mode == "verified" and self._verified.get(record.key_id) == (record.salt, record.hash):
            return
        age = self.age_s()
        since = "never confirmed" if age is None else f"last confirmed {age:.0f}s ago"
        raise GatewayError(
            503,
            f"This gateway's key list is stale ({since}); it cannot tell whether this key was "
            "revoked. Retry later or through another region",
            code="key_state_stale",
            headers={"Retry-After": "5"},
        )
