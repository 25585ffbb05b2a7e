"""The wire contract of a non-streamed answer's time to first token (a Fleet extension).

A gateway measures a stream's first token itself; a non-streamed answer arrives whole, so
the hop that answered says when its first token came: `TTFT_HEADER`, seconds from the
request's arrival there to its first generated token. A replica stamps its own (the engine's
request timestamps, or the sim's model clock); a gateway replaces it on the answer it relays
with its own figure (its time before the upstream call plus the upstream's), so a peer's
answer reaches the first gateway carrying the peer's measurement. The value is data from
another process: a reader takes it only when it is a finite number within the time it can
have taken (`read_ttft`), and ignores it otherwise.
"""

from __future__ import annotations

import math

TTFT_HEADER = "x-fleet-ttft-s"
MAX_VALUE_CHARS = 32  # a float's text; anything longer is not one of ours


def ttft_header(seconds: float | None) -> dict[str, str]:
    """The header for an answer whose first token came `seconds` after arrival ({} when
    there was none, or the figure is not a finite, non-negative number)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return {}
    return {TTFT_HEADER: f"{seconds:.6f}"}


def read_ttft(value: str | None, at_most: float) -> float | None:
    """The header's seconds when they are a finite number in [0, `at_most`] (the time the
    answer can have taken); None for anything else."""
    if value is None or len(value) > MAX_VALUE_CHARS:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0 or seconds > at_most:
        return None
    return seconds
