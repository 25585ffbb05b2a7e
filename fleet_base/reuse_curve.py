"""How much of a prompt a prefix cache of any size would hold, from one pass over the
requests: each block's LRU stack distance (the distinct blocks touched since it was last
touched; Mattson et al., 1970). An LRU of C blocks holds a block exactly when its distance
is under C, so one pass answers for every cache size at once.

A prompt's hits are its leading blocks held (a chained block id needs every earlier one),
so at size C it hits the longest prefix whose distances all fall under C. A request's
`ReuseCurve` is that step function in tokens: `(cache_tokens, hit_tokens)` steps, each
"at a cache of more than `cache_tokens` tokens, `hit_tokens` of this prompt are cached".

Why: a fleet's prefix caches grow with its replicas, so the share of prompt tokens that
need no prefill depends on the fleet size. A policy that knows only the reuse it observes
at today's size cannot see what a larger fleet would save (docs/autoscaling.md)."""

from __future__ import annotations

from collections.abc import Sequence

ReuseCurve = tuple[tuple[int, int], ...]


class StackDistances:
    """LRU stack distances over block ids (a Fenwick tree over access times), remembering
    blocks up to `limit_blocks` deep: a deeper block is a miss at every size asked about,
    and forgetting it bounds the memory."""

    def __init__(self, limit_blocks: int) -> None:
        if limit_blocks < 1:
            raise ValueError("limit_blocks must be at least 1")
        self.limit = limit_blocks
        self._size = 4 * limit_blocks + 64
        self._tree = [0] * (self._size + 1)
        self._last: dict[int, int] = {}  # block -> its latest access time
        self._t = 0

    def _add(self, i: int, v: int) -> None:
        i += 1
        while i <= self._size:
            self._tree[i] += v
            i += i & -i

    def _prefix(self, i: int) -> int:
        """Marks at times < i."""
        s = 0
        while i > 0:
            s += self._tree[i]
            i -= i & -i
        return s

    def distance(self, block: int) -> int | None:
        """The block's distance now (None: never seen, or deeper than the limit)."""
        prev = self._last.get(block)
        if prev is None:
            return None
        distance = len(self._last) - self._prefix(prev + 1)
        return distance if distance < self.limit else None

    def touch(self, block: int) -> None:
        """The block is used: the most recent now."""
        if self._t >= self._size:
            self._compact()
        prev = self._last.get(block)
        if prev is not None:
            self._add(prev, -1)
        self._add(self._t, 1)
        self._last[block] = self._t
        self._t += 1

    def _compact(self) -> None:
        """Renumber the remembered blocks by recency, keeping the `limit` most recent."""
        order = sorted(self._last.items(), key=lambda kv: kv[1])[-self.limit :]
        self._tree = [0] * (self._size + 1)
        self._last = {}
        for t, (block, _) in enumerate(order):
            self._last[block] = t
            self._add(t, 1)
        self._t = len(order)


def prompt_curve(distances: Sequence[int | None], block_tokens: int, prompt_tokens: int) -> ReuseCurve:
    """A prompt's `ReuseCurve` from its blocks' distances in order: the running maximum
    distance is the smallest cache (in blocks, less one) that holds that prefix. The last
    prompt token is always computed, as the engines do."""
    steps: list[tuple[int, int]] = []
    deepest = -1
    for k, d in enumerate(distances, start=1):
        if d is None:
            break
        deepest = max(deepest, d)
        hit = min(k * block_tokens, prompt_tokens - 1)
        if hit <= 0:
            continue
        cache = deepest * block_tokens
        if steps and steps[-1][0] == cache:
            steps[-1] = (cache, hit)
        else:
            steps.append((cache, hit))
    return tuple(steps)


def hit_tokens(curve: ReuseCurve, cache_tokens: float) -> int:
    """Tokens of the prompt a cache of `cache_tokens` holds."""
    hit = 0
    for need, tokens in curve:
        if need >= cache_tokens:
            break
        hit = tokens
    return hit


class ReuseCurves:
    """Feeds each request's prompt blocks through one `StackDistances` (every request, in
    arrival order, as the caches see them) and gives its `ReuseCurve`."""

    def __init__(self, limit_tokens: int, block_tokens: int) -> None:
        self.block_tokens = max(1, block_tokens)
        self.distances = StackDistances(max(1, limit_tokens // self.block_tokens))

    def observe(self, blocks: Sequence[int], prompt_tokens: int) -> ReuseCurve:
        """The prompt's curve as the caches stood when it arrived; then its blocks are the
        most recent, its first block most of all (engines free a request's blocks tail
        first, so a prefix's tail is evicted before its head)."""
        seen = [self.distances.distance(b) for b in blocks]
        for b in reversed(blocks):
            self.distances.touch(b)
        return prompt_curve(seen, self.block_tokens, prompt_tokens)
