"""The timing of one simulated replica: continuous batching in continuous time.

Pure and clock-free: the caller says what time it is (`advance(now)`), so the same object
runs in real time (the sim server) and in virtual time (`fleetctl simulate`).

Scheduling (vLLM-v0-like, prefill first): waiting requests are admitted in arrival order
while the batch has room (`max_num_seqs`) and their prompt + output tokens fit the free KV
capacity (reserved up front, so nothing is ever preempted), up to `max_prefill_tokens` per
prefill batch. A prefill batch takes `prefill_time(sum of prompt tokens)` and yields each
request's first token; then every running sequence gains one token per decode step of
`decode_time(batch size)`. Between events the batch is constant, so time advances in
segments, not steps: an hour of trace costs a few events per request, not per token.
Prefix hits in the cache's host tier are loaded back before the batch's prefill: the batch
pays their load time (`fleet_base.kv_tier_cost`) instead of their prefill.

With `long_prefill_token_threshold` T (the engine's long-prefill cap, vLLM's meaning) a
prompt needing more than T new tokens is long: it prefills in a lane of its own, one at a
time, T tokens a step (a step of T tokens alone), and shorter prompts behind it go past it
into the other lane. A short batch of S tokens beside it shares its steps: they carry T long
tokens and up to B - T short ones (B = `max_prefill_tokens`), so the batch takes
`prefill_time(T + S)` (or S / (B - T) full steps) and the long prompt gains T a step."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from agent.sim.prefix_cache import PrefixCacheModel
from fleet_base.kv_tier_cost import load_seconds, prefix_hit
from fleet_base.profile import PerfProfile

EPS = 1e-9
LOOKAHEAD = 64  # waiting requests that may be passed in one admission (the engine's bound)


@dataclass
class SimRequest:
    rid: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    start_clock: float = 0.0  # replica decode clock when its first token came out
    finish_clock: float = 0.0
    tag: object = field(default=None, compare=False)  # the caller's own data
    block_hashes: tuple[int, ...] = ()  # chained prefix-block ids (prefix caching)
    block_tokens: int = 16
    cached_tokens: int = 0  # prompt tokens found in the replica's prefix cache at admission
    host_tokens: int = 0  # of those, found in its host tier (loaded back, not prefilled)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class ReplicaModel:
    """One replica's queue, batch and clock. `advance(now)` returns the requests that got
    their first token or finished since the last call, in time order."""

    def __init__(self, profile: PerfProfile, now: float = 0.0, cache: PrefixCacheModel | None = None) -> None:
        self.profile = profile
        self.cache = cache  # with one, a prompt's cached prefix is not prefilled again
        self.t = now
        self.clock = 0.0  # decode steps every running sequence has taken
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}
        self._finish_heap: list[tuple[float, int]] = []
        self.prefilling: list[SimRequest] = []
        self.prefill_end = math.inf
        self.long_prefilling: SimRequest | None = None  # the long lane (a threshold is set)
        self.long_end = math.inf
        self._lane_t = now  # the long lane's tokens left, as of this time
        self._long_left = 0.0
        self._short_tokens = 0  # the short batch's new tokens (its steps' size)
        self.kv_used = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0

    # ------------------------------------------------------------ observation

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling) + (self.long_prefilling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self.profile.kv_capacity_tokens)

    def tokens_out(self, req: SimRequest) -> int:
        """Tokens generated for `req` so far (as of the last advance)."""
        if req.finished_at is not None:
            return req.output_tokens
        if req.first_token_at is None:
            return 0
        return min(req.output_tokens, 1 + int(self.clock - req.start_clock + EPS))

    def tokens_generated(self) -> int:
        """Output tokens generated so far, finished requests and running ones (as of the
        last advance): a counter that moves with every decode step, not only at finishes."""
        return self.generated_tokens + sum(self.tokens_out(r) for r in self.running.values())

    def idle(self) -> bool:
        return not self.running and not self._in_prefill() and not self.waiting

    def _in_prefill(self) -> bool:
        return bool(self.prefilling) or self.long_prefilling is not None

    def next_event_time(self) -> float:
        if self.prefilling:
            return min(self.prefill_end, self.long_end)
        if self.long_prefilling is not None:
            return min(self.long_end, self._next_finish(self._long_step_s()))
        if self._finish_heap:
            return self._next_finish(self.profile.decode_time(len(self.running)))
        return math.inf

    def _next_finish(self, step: float) -> float:
        """When the next running sequence finishes at `step` seconds a decode step."""
        if not self._finish_heap:
            return math.inf
        return self.t + max(0.0, self._finish_heap[0][0] - self.clock) * step

    # ------------------------------------------------------------ input

    def submit(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Queue a request at `now` (>= the last advance); returns events up to `now`."""
        req.output_tokens = max(1, req.output_tokens)
        req.prompt_tokens = max(1, req.prompt_tokens)
        events = self.advance(now)
        self.waiting.append(req)
        if not self.prefilling or (self._threshold() and self.long_prefilling is None):
            self._start_prefill()
        return events

    # ------------------------------------------------------------ time

    def advance(self, now: float) -> list[SimRequest]:
        events: list[SimRequest] = []
        while True:
            if self.prefilling:
                if min(self.prefill_end, self.long_end) > now + EPS:
                    # Decode is paused while a prefill batch runs.
                    self.t = max(self.t, now)
                    break
                if self.prefill_end <= self.long_end:
                    self._finish_prefill(events)
                else:
                    self._finish_long(events)
                self._start_prefill()  # prefill first: admit what waited meanwhile
                continue
            if self.long_prefilling is not None:
                # A long prompt alone: its steps of T tokens carry every running sequence's next one.
                step = self._long_step_s()
                finish = self._next_finish(step)
                if min(self.long_end, finish) > now + EPS:
                    self._decode_until(now, step)
                    break
                if self.long_end <= finish:
                    self._decode_until(self.long_end, step)
                    self._finish_long(events)
                else:
                    self._lanes_at(finish)  # the batch, so the step, changes
                    self._pop_finishes(finish, events)
                    self._lane_ends()
                self._start_prefill()
                continue
            if self._finish_heap:
                step = self.profile.decode_time(len(self.running))
                at = self._next_finish(step)
                if at > now + EPS:
                    self._decode_until(now, step)
                    break
                self._pop_finishes(at, events)
                self._start_prefill()
                continue
            self.t = max(self.t, now)
            if not self._start_prefill():
                break
        return events

    def _decode_until(self, t: float, step: float) -> None:
        """The running sequences decode at `step` seconds a token until `t`."""
        if t > self.t:
            self.clock += (t - self.t) / step if step > 0 else 0.0
            self.t = t

    def _pop_finishes(self, at: float, events: list[SimRequest]) -> None:
        """The sequences whose last token comes at `at` finish (the clock reaches theirs)."""
        self.clock = max(self.clock, self._finish_heap[0][0])
        self.t = at
        while self._finish_heap and self._finish_heap[0][0] <= self.clock + EPS:
            _, rid = heapq.heappop(self._finish_heap)
            req = self.running.pop(rid)
            req.finished_at = at
            self.kv_used -= req.kv_tokens
            self.generated_tokens += req.output_tokens
            events.append(req)

    def _threshold(self) -> int:
        return self.profile.long_prefill_token_threshold

    def _admissible(self, req: SimRequest, batch: list[SimRequest]) -> bool:
        """Whether `req` fits a slot and the KV left (a request bigger than the cache runs
        alone)."""
        prof = self.profile
        fits_kv = self.kv_used + req.kv_tokens <= prof.kv_capacity_tokens
        alone = not self.running and not self.prefilling and not batch and self.long_prefilling is None
        return self.num_running + len(batch) < prof.max_num_seqs and (fits_kv or alone)

    def _new_tokens(self, req: SimRequest) -> int:
        """The prefill `req` would need here now (its prompt less what the cache holds)."""
        if self.cache is None or not req.block_hashes:
            return req.prompt_tokens
        device, host = self.cache.peek_tiers(req.block_hashes)
        return req.prompt_tokens - prefix_hit(device, host, req.block_tokens, req.prompt_tokens).tokens

    def _admit(self, req: SimRequest) -> tuple[int, float]:
        """Take `req` into prefill: its new tokens and the seconds its host hit takes to load."""
        req.admitted_at = self.t
        load_s = 0.0
        if self.cache is not None and req.block_hashes:
            device, host = self.cache.lookup_tiers(req.block_hashes)
            hit = prefix_hit(device, host, req.block_tokens, req.prompt_tokens)
            req.cached_tokens, req.host_tokens = hit.tokens, hit.host_tokens
            self.cache.insert(req.block_hashes)
            load_s = load_seconds(self.profile, req.host_tokens)
        self.kv_used += req.kv_tokens
        tokens = req.prompt_tokens - req.cached_tokens
        self.prompt_tokens += tokens
        return tokens, load_s

    def _start_prefill(self) -> bool:
        if self._threshold():
            return self._start_lanes()
        batch: list[SimRequest] = []
        tokens = 0
        load_s = 0.0
        prof = self.profile
        while self.waiting:
            req = self.waiting[0]
            if not self._admissible(req, batch):
                break
            if batch and tokens + req.prompt_tokens > prof.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append(req)
            new, load = self._admit(req)
            tokens += new
            load_s += load
        if not batch:
            return False
        self.prefilling = batch
        self.prefill_end = self.t + prof.prefill_time(tokens) + load_s
        return True

    def _long_step_s(self) -> float:
        """A step of the long prompt alone: T of its tokens and one of every running
        sequence's."""
        decode = self.profile.decode_time(len(self.running)) if self.running else 0.0
        return self.profile.prefill_time(self._threshold()) + decode

    def _long_rate(self) -> float:
        """Long-prompt tokens a second now: T a step, in steps of its own (with the
        decodes) or of T + the short batch's share beside it (decode paused)."""
        threshold = self._threshold()
        prof = self.profile
        if self.prefilling:
            step_s = prof.prefill_time(
                threshold + min(self._short_tokens, prof.max_prefill_tokens - threshold)
            )
        else:
            step_s = self._long_step_s()
        return threshold / max(step_s, EPS)

    def _short_seconds(self, tokens: int) -> float:
        """A short batch's prefill: alone as without the cap, beside a long prompt in
        steps that also carry T of its tokens."""
        prof = self.profile
        if self.long_prefilling is None:
            return prof.prefill_time(tokens)
        room = prof.max_prefill_tokens - self._threshold()
        if tokens <= room:
            return prof.prefill_time(self._threshold() + tokens)
        return tokens / room * prof.prefill_time(prof.max_prefill_tokens)

    def _lanes_at(self, t: float) -> None:
        """Bring the long lane's tokens left to `t` (before a lane starts or ends)."""
        if self.long_prefilling is not None:
            self._long_left = max(0.0, self._long_left - max(0.0, t - self._lane_t) * self._long_rate())
        self._lane_t = t

    def _lane_ends(self) -> None:
        """The long lane's end at its rate from `_lane_t` (after a lane started or ended)."""
        if self.long_prefilling is None:
            self.long_end = math.inf
        else:
            self.long_end = self._lane_t + self._long_left / self._long_rate()

    def _start_lanes(self) -> bool:
        """Fill whichever lane is free, in arrival order, letting short prompts past a long
        one that must wait for the long lane (up to `LOOKAHEAD` of them)."""
        threshold = self._threshold()
        prof = self.profile
        short_free = not self.prefilling
        batch: list[SimRequest] = []
        tokens = 0
        load_s = 0.0
        long_req: SimRequest | None = None
        long_work = 0.0
        skipped: list[SimRequest] = []
        while self.waiting and len(skipped) < LOOKAHEAD:
            req = self.waiting[0]
            if not self._admissible(req, batch if long_req is None else [*batch, long_req]):
                break
            if self._new_tokens(req) > threshold:
                if self.long_prefilling is None and long_req is None:
                    self.waiting.popleft()
                    new, load = self._admit(req)
                    # Its host hits' load, as the long-prompt tokens that time would prefill alone.
                    long_req, long_work = req, new + load * threshold / max(prof.prefill_time(threshold), EPS)
                    continue
                skipped.append(self.waiting.popleft())  # the long lane is taken: shorter ones go past
                continue
            if not short_free or (batch and tokens + req.prompt_tokens > prof.max_prefill_tokens):
                if self.long_prefilling is not None or long_req is not None:
                    break
                skipped.append(self.waiting.popleft())  # look on for a long one for the free lane
                continue
            self.waiting.popleft()
            batch.append(req)
            new, load = self._admit(req)
            tokens += new
            load_s += load
        self.waiting.extendleft(reversed(skipped))
        if not batch and long_req is None:
            return False
        self._lanes_at(self.t)
        if long_req is not None:
            self.long_prefilling = long_req
            self._long_left = long_work
            if self.prefilling and not batch:
                # Beside a batch already in its step (timed alone): it joins the step after.
                self._lane_t = self.prefill_end
        if batch:
            self.prefilling = batch
            self._short_tokens = tokens
            self.prefill_end = self.t + self._short_seconds(tokens) + load_s
        self._lane_ends()
        return True

    def _finish_long(self, events: list[SimRequest]) -> None:
        end = self.long_end
        self.t = max(self.t, end)
        self._lanes_at(end)
        req = self.long_prefilling
        assert req is not None
        self.long_prefilling = None
        self._first_token(req, end, events)
        self._lane_ends()

    def _finish_prefill(self, events: list[SimRequest]) -> None:
        end = self.prefill_end
        self.t = max(self.t, end)
        if self._threshold():
            self._lanes_at(end)
        for req in self.prefilling:
            self._first_token(req, end, events)
        self.prefilling = []
        self.prefill_end = math.inf
        if self._threshold():
            self._lane_ends()

    def _first_token(self, req: SimRequest, end: float, events: list[SimRequest]) -> None:
        req.first_token_at = end
        req.start_clock = self.clock
        req.finish_clock = self.clock + req.output_tokens - 1
        events.append(req)
        if req.output_tokens <= 1:
            req.finished_at = end
            self.kv_used -= req.kv_tokens
            self.generated_tokens += req.output_tokens
        else:
            self.running[req.rid] = req
            heapq.heappush(self._finish_heap, (req.finish_clock, req.rid))
