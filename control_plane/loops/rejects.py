"""Messages the control plane refused: counted per (subject pattern, reason) for
`fleet_control_plane_rejected_messages_total`, each logged with its reason, skipped.

The label is the subject *pattern* (`fleet.v1.heartbeat.*`), not the subject: a sender
must not be able to mint label values. Logging is at warning for the first of each
(pattern, reason) per minute and at debug after, so a flood of one bad message cannot
flood the log."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from fleet_base.wire import REASONS

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
# Every (pattern, reason) is exported, 0 until it happens, so dashboards always have series.
PATTERNS = ("fleet.v1.heartbeat.*", "fleet.v1.events.*", "fleet.v1.usage.*")


class Rejections:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._logged: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()  # stores run in threads

    def reject(self, pattern: str, reason: str, subject: str, detail: object) -> None:
        key = (pattern, reason)
        now = time.monotonic()
        with self._lock:
            self.counts[key] += 1
            loud = now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S
            if loud:
                self._logged[key] = now
        text = str(detail)
        text = text if len(text) <= 300 else text[:297] + "..."
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "rejected a message on %s (%s): %s",
            subject[:120],
            reason,
            text,
        )

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return {**{(p, r): 0 for p in PATTERNS for r in REASONS}, **self.counts}
