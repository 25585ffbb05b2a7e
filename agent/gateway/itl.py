"""Inter-token latency of a stream, as the gateway sees it: the mean time between
tokens from the first chunk that carried one to the last."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenClock:
    first_at: float | None = None
    last_at: float | None = None
    chunks: int = 0  # chunks that carried tokens

    def tick(self, now: float) -> None:
        """A chunk carrying tokens arrived at `now`."""
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.chunks += 1

    def itl(self, tokens: int) -> float | None:
        """Mean seconds per token after the first (None: fewer than two chunks or tokens)."""
        if self.first_at is None or self.last_at is None or self.chunks < 2 or tokens < 2:
            return None
        return (self.last_at - self.first_at) / (tokens - 1)
