"""What a cached prefix is worth to a replica, by the tier that holds it: the one scoring
function the gateway's routing plan and `fleetctl simulate` both call, so the two cannot
value a host-tier hit differently.

A device hit saves its prefill outright. A host-tier hit saves the prefill too, but must be
copied back to the device first, so it is worth what that copy leaves of the prefill it
replaces: `1 - load_s / prefill_s` per token, never below a miss (0) and never above a
device hit (1). The prefill side is the profile's cheapest per-token prefill (a full
prefill batch), so the host tier is valued low rather than high when the curve is unsure.

A replica is scored by the request's expected time to first token there, in seconds
(`expected_ttft_s`): the wait before its prefill can start (the prefills sent there ahead
of it, less what of them is done: `queue_wait_s`, plus the step in flight) and its own
prefill less what the replica's tiers save. Queued work and saved work are one unit, so a
holder wins exactly while its queue costs less than the recompute its cache saves.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter

from fleet_base.profile import PerfProfile

# A replica whose host tier is known to exist but whose profile says nothing of its cost
# (a live engine started with `--kv-offloading-size` and no profile): half a device hit.
# Below a device hit on purpose, so an unmeasured tier never outranks a device copy.
UNKNOWN_HOST_TOKEN_VALUE = 0.5
EPS = 1e-9  # a queue that ends on a step's edge does not start another


def host_token_value(kv_bytes_per_token: float, h2d_bytes_per_s: float, prefill_s_per_token: float) -> float:
    """Share of one token's prefill a host-tier hit saves after its load, in [0, 1]."""
    if kv_bytes_per_token <= 0 or h2d_bytes_per_s <= 0 or prefill_s_per_token <= 0:
        return 0.0
    load_s = kv_bytes_per_token / h2d_bytes_per_s
    return min(1.0, max(0.0, 1.0 - load_s / prefill_s_per_token))


def load_token_value(profile: PerfProfile) -> float:
    """What a host hit saves on the profile's hardware, whatever its host tier's size (a
    live replica's tier is known from its KV events, not from the profile)."""
    batch = float(profile.max_prefill_tokens)
    return host_token_value(
        profile.kv_bytes_per_token, profile.h2d_bytes_per_s, profile.prefill_time(batch) / batch
    )


def profile_host_token_value(profile: PerfProfile) -> float:
    """The profile's host-hit value; 0 when it has no host tier."""
    return load_token_value(profile) if profile.host_kv_bytes > 0 else 0.0


@dataclass(frozen=True)
class PrefixHit:
    """A replica's cached share of one prompt, in tokens, by tier."""

    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Prompt tokens the replica need not prefill (loaded or already on the device)."""
        return self.device_tokens + self.host_tokens

    def value(self, host_value: float) -> float:
        """Prefill saved, in token equivalents: device hits in full, host hits after their load."""
        return self.device_tokens + self.host_tokens * host_value


def prefix_hit(device_blocks: int, host_blocks: int, block_tokens: int, prompt_tokens: int) -> PrefixHit:
    """The leading `device_blocks` then `host_blocks` of a prompt as tokens. The last prompt
    token is always computed (as the engine does), so the hit stops one short of the prompt;
    the device part comes first."""
    cap = max(0, prompt_tokens - 1)
    device = max(0, min(device_blocks * block_tokens, cap))
    both = max(0, min((device_blocks + host_blocks) * block_tokens, cap))
    return PrefixHit(device, both - device)


@dataclass(frozen=True)
class PrefillTiming:
    """A replica's speed as the routing cost reads it: seconds a prompt token's prefill
    takes at a full prefill batch (the profile's cheapest, linear past a few thousand
    tokens), and one step (a new prompt waits for the step in flight to end)."""

    s_per_token: float
    step_s: float = 0.0
    # The engine's long-prefill cap (0: off): a long prompt takes this many tokens of every
    # step, so a short prompt beside it is prefilled in a step that also carries them; and
    # the room such a step leaves the short ones (the step's budget less the cap).
    long_threshold: int = 0
    long_room: int = 0

    def prefill_s(self, tokens: float) -> float:
        return max(0.0, tokens) * self.s_per_token

    def is_short(self, new_tokens: float) -> bool:
        """Whether a prompt needing `new_tokens` of prefill goes past long ones."""
        return self.long_threshold > 0 and new_tokens <= self.long_threshold


def long_prefill_timing(timing: PrefillTiming, threshold: int, budget: int) -> PrefillTiming:
    """`timing` with the engine's long-prefill cap (`threshold` tokens of a `budget`-token
    step; a cap at or past the step's budget caps nothing)."""
    if not 0 < threshold < budget:
        return replace(timing, long_threshold=0, long_room=0)
    return replace(timing, long_threshold=threshold, long_room=budget - threshold)


def profile_timing(profile: PerfProfile) -> PrefillTiming:
    batch = profile.max_prefill_tokens
    timing = PrefillTiming(profile.prefill_time(float(batch)) / batch, profile.decode_time(1.0))
    return long_prefill_timing(timing, profile.long_prefill_token_threshold, batch)


@dataclass(frozen=True)
class QueueEnd:
    """When a replica's pending prefills end, run one after another in the order sent (each
    starting when it arrived or when the one before ended, whichever is later): all of them,
    and the short ones alone (those the engine lets past long ones, `PrefillTiming.is_short`;
    read only where the timing has a long-prefill cap)."""

    end: float = -math.inf
    short_end: float = -math.inf
    has_long: bool = False  # a prefill past the long-prefill cap is pending

    def wait_s(self, now: float, timing: PrefillTiming, *, short: bool = False) -> float:
        """Seconds from `now` until a new prompt's prefill could start (`queue_wait_s`)."""
        if not (short and timing.long_threshold > 0):
            return max(0.0, self.end - now)
        queued = max(0.0, self.short_end - now)
        if not self.has_long:
            return queued
        tokens_left = queued / timing.s_per_token if timing.s_per_token > 0 else 0.0
        steps = math.ceil(tokens_left / max(1, timing.long_room) - EPS) + 1
        return queued + steps * timing.prefill_s(timing.long_threshold)


def queue_end(pending: Iterable[tuple[float, int]], timing: PrefillTiming) -> QueueEnd:
    """The `QueueEnd` of pending prefills (sent at, new prefill tokens), in whatever order
    listed (those sent at one instant, in the order listed)."""
    end = short_end = -math.inf
    has_long = False
    for at, tokens in sorted(pending, key=itemgetter(0)):
        seconds = timing.prefill_s(tokens)
        end = max(end, at) + seconds
        if timing.is_short(tokens):
            short_end = max(short_end, at) + seconds
        else:
            has_long = True
    return QueueEnd(end, short_end, has_long)


def queue_wait_s(
    pending: Sequence[tuple[float, int]], now: float, timing: PrefillTiming, *, short: bool = False
) -> float:
    """Seconds until a replica could start a new prompt's prefill: its pending prefills
    (sent at, new prefill tokens) run one after another in the order sent, each starting when
    it arrived or when the one before ended, whichever is later; what is left of that at
    `now`. The part of a long prefill already done is not waited for again.

    `short`: the wait of a prompt the engine lets past long ones (`timing.is_short`): only the
    short prefills ahead count, and while a long one is pending each step, the prompt's own
    included, also carries `long_threshold` of its tokens (one step per `long_room` short
    tokens)."""
    return queue_end(pending, timing).wait_s(now, timing, short=short)


class _Lane:
    """One lane's queue end, kept as prefills are sent and the oldest leaves. Unrolled, the
    fold `end = max(end, at) + seconds` is the largest, over the prefills, of one's send time
    plus the seconds of it and all sent after it. With `spent` the seconds of every prefill
    this lane was ever sent and `before` that sum when one was sent, a prefill's term is
    `spent + (at - before)` while only older ones have left; so the end is `spent` plus the
    largest `at - before` of those still here: a sliding-window maximum."""

    __slots__ = ("keys", "peaks", "spent")

    def __init__(self) -> None:
        self.spent = 0.0
        self.keys: deque[Hashable] = deque()  # oldest first
        self.peaks: deque[tuple[Hashable, float]] = deque()  # (key, at - before), falling

    def add(self, key: Hashable, at: float, seconds: float) -> None:
        term = at - self.spent
        self.spent += seconds
        while self.peaks and self.peaks[-1][1] <= term:
            self.peaks.pop()
        self.peaks.append((key, term))
        self.keys.append(key)

    def pop_oldest(self, key: Hashable) -> bool:
        """Drop `key` if it is the oldest here; False if it is not (the lane must be rebuilt)."""
        if not self.keys or self.keys[0] != key:
            return False
        self.keys.popleft()
        if self.peaks[0][0] == key:
            self.peaks.popleft()
        return True

    def end(self) -> float:
        return self.spent + self.peaks[0][1] if self.peaks else -math.inf


class PendingPrefills:
    """A replica's prefills sent and not yet done, with their queue's end kept as they come
    and go: routing asks every replica's wait for every request, and a burst makes queues
    thousands long, so an ask must not cost a pass over the queue. Sent in order and done
    oldest first (the usual case) costs O(1) each; anything else refolds once, at the next ask."""

    def __init__(self) -> None:
        self._items: dict[Hashable, tuple[float, int]] = {}
        self._keys = itertools.count()
        self._last_at = -math.inf
        self._timing: PrefillTiming | None = None  # the timing the lanes below are kept for
        self._all = _Lane()
        self._short = _Lane()
        self._long = 0  # of those, past the timing's long-prefill cap

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> tuple[tuple[float, int], ...]:
        """(sent at, new prefill tokens) of each, in the order sent."""
        return tuple(self._items.values())

    def add(self, at: float, tokens: int, key: Hashable | None = None) -> Hashable:
        """One more prefill; returns its key (given, or a fresh one)."""
        key = next(self._keys) if key is None else key
        if key in self._items:
            self.pop(key)
        self._items[key] = (at, tokens)
        if self._timing is not None and at >= self._last_at:
            self._keep(key, at, tokens, self._timing)
        else:
            self._timing = None
        self._last_at = max(self._last_at, at)
        return key

    def pop(self, key: Hashable) -> tuple[float, int] | None:
        item = self._items.pop(key, None)
        if item is None or self._timing is None:
            return item
        timing = self._timing
        if not self._all.pop_oldest(key):
            self._timing = None
        elif timing.is_short(item[1]):
            if not self._short.pop_oldest(key):
                self._timing = None
        else:
            self._long -= 1
        return item

    def release(self, tokens: int) -> None:
        """The oldest prefill of `tokens` is done, else the oldest of any size (a caller that
        tracks no keys knows only the size)."""
        if not self._items:
            return
        key = next((k for k, (_, t) in self._items.items() if t == tokens), next(iter(self._items)))
        self.pop(key)

    def wait_s(self, now: float, timing: PrefillTiming, *, short: bool = False) -> float:
        """`queue_wait_s` of these prefills."""
        if self._timing is not timing and self._timing != timing:
            self._rebuild(timing)
        end = QueueEnd(self._all.end(), self._short.end(), self._long > 0)
        return end.wait_s(now, timing, short=short)

    def _keep(self, key: Hashable, at: float, tokens: int, timing: PrefillTiming) -> None:
        seconds = timing.prefill_s(tokens)
        self._all.add(key, at, seconds)
        if timing.is_short(tokens):
            self._short.add(key, at, seconds)
        else:
            self._long += 1

    def _rebuild(self, timing: PrefillTiming) -> None:
        self._all, self._short, self._long = _Lane(), _Lane(), 0
        for key, (at, tokens) in sorted(self._items.items(), key=lambda kv: kv[1][0]):
            self._keep(key, at, tokens, timing)
        self._timing = timing


def expected_ttft_s(
    hit: PrefixHit, prompt_tokens: int, wait_s: float, host_value: float, timing: PrefillTiming
) -> float:
    """A replica's expected time to first token for a prompt, lower is better: the wait
    before its prefill starts, then the prefill its cache does not save (a device hit is
    free, a host hit costs its load: `host_value` of a token saved)."""
    return wait_s + timing.prefill_s(float(prompt_tokens) - hit.value(host_value))


def load_seconds(profile: PerfProfile, host_tokens: int) -> float:
    """Time to copy `host_tokens` tokens' KV from the host tier back to the device (the
    load a host hit pays instead of their prefill)."""
    if host_tokens <= 0 or profile.kv_bytes_per_token <= 0:
        return 0.0
    return host_tokens * profile.kv_bytes_per_token / profile.h2d_bytes_per_s
