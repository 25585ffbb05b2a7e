"""n-gram drafts: the tokens that followed the latest earlier occurrence of the sequence's tail.

`NgramIndex` keeps, for every n in [min, max], a map from each n-gram of the sequence to the
position right after its latest occurrence, updated as tokens are appended (O(max - min + 1)
per token), so proposing costs a few dict lookups per step however long the sequence is.
The longest matching n wins. A match close to the end (a repeating pattern of period p < k)
is continued periodically: draft token j copies the token p positions before it.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n -> n-gram -> index of the token that followed its latest occurrence
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        for t in tokens:
            i = len(toks)  # `t` is the continuation of every n-gram ending just before it
            for n, table in self._next.items():
                if i >= n:
                    table[tuple(toks[i - n : i])] = i
            toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens to follow the current tail ([] when no n-gram matches)."""
        toks = self.tokens
        size = len(toks)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = self._next[n].get(tuple(toks[size - n :]))
            if start is None:
                continue
            draft: list[int] = []
            for j in range(k):
                pos = start + j
                draft.append(toks[pos] if pos < size else draft[pos - size])
            return draft
        return []


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """One-shot form of `NgramIndex` (tests and tools): drafts for the tail of `tokens`."""
    index = NgramIndex(min_n, max_n)
    index.append(tokens)
    return index.propose(k)
