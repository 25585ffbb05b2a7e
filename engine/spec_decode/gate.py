"""When to draft at all: the batch-size gate and the per-sequence backoff.

Drafting pays only while a step is memory-bound: at batch 1 a verified chunk of k + 1
tokens reads the weights once, like a plain step, and saves the steps its accepted drafts
replace. Once a step's batch is large the extra verified rows cost their full compute, so
`drafts_this_step` turns drafting off for the step when the decoding batch reaches
`disable_by_batch_size` (vLLM's name). A sequence whose drafts keep being rejected pays for
rows it never keeps, so `Backoff` stops drafting it for a growing number of steps. Both only
ever draft less, so outputs are unchanged. Plain synchronous policies, table-tested.
"""

from __future__ import annotations

from dataclasses import dataclass

# Consecutive fully rejected verifies before a sequence is skipped, and the longest skip.
BACKOFF_AFTER = 2
BACKOFF_MAX_SKIP = 16


def drafts_this_step(num_decoding: int, disable_by_batch_size: int | None) -> bool:
    """Whether a step with `num_decoding` decoding sequences drafts (None: always)."""
    return disable_by_batch_size is None or num_decoding < disable_by_batch_size


def backoff_skip(zero_streak: int, after: int = BACKOFF_AFTER, cap: int = BACKOFF_MAX_SKIP) -> int:
    """Steps to skip after `zero_streak` consecutive zero-accept verifies: 0 below `after`,
    then 1, 2, 4, ... up to `cap`."""
    if zero_streak < after:
        return 0
    return min(cap, 1 << min(zero_streak - after, cap.bit_length()))


@dataclass
class Backoff:
    """One sequence's backoff state: its run of fully rejected verifies and steps left to skip."""

    zero_streak: int = 0
    skip_left: int = 0

    def should_draft(self) -> bool:
        """Called once per step the sequence could be drafted; a skipped step counts down."""
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def observe(self, accepted: int) -> None:
        """After a verify: any accepted draft resets; a zero-accept one may start a skip."""
        if accepted > 0:
            self.zero_streak = self.skip_left = 0
            return
        self.zero_streak += 1
        self.skip_left = backoff_skip(self.zero_streak)
