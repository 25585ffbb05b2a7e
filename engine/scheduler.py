"""Continuous batching: which sequences run this step, and how many tokens each.

One unified policy for prefill and decode (as in vLLM v1): every request has a number of
known tokens (`num_tokens`) and a number whose KV is computed (`num_computed_tokens`);
each step gives running requests, then waiting ones, up to `num_tokens - num_computed`
new tokens within a per-step token budget. A long prompt is therefore prefilled in
chunks alongside decodes. When the KV pool runs dry the least important, latest running
request is preempted: its blocks are freed and it is recomputed later (its full blocks
usually survive in the prefix cache, or in the host tier below it, so recomputation is
cheap).

A long prompt (more than `long_prefill_token_threshold` tokens left to prefill, vLLM's flag
and meaning) takes at most that many tokens a step, and no more than
`max_long_partial_prefills` long prompts of a priority or above prefill at once: a short
prompt arriving behind a long one (a cache hit behind a 50k-token miss) is prefilled in the
next step instead of after the whole long prefill, in a step of at most T + its own tokens.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager, PrefixHit
from engine.request import Request, RequestStatus
from fleet_base.openai_contract.priority import DEFAULT_PRIORITY

MIN_OBSERVED_TOKENS = 32  # steps with fewer new tokens are mostly fixed cost, not per token
STEP_COST_ALPHA = 0.2  # weight of the newest step in the cost per token (an EMA)
LONG_LOOKAHEAD = 64  # waiting requests looked at past long ones that must wait for a long slot


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Speculative drafts at the end of this chunk (the first of request.spec_token_ids).
    num_draft_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, i.e. yields a next token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Waiting requests ordered by (priority, arrival); FCFS when priorities are equal.

    Preempted requests go back with their original arrival time, so they come first again.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tie = itertools.count()
        self._removed: set[int] = set()  # id(request) of lazily removed entries
        self._len = 0

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tie), request))
        self._len += 1

    def _skip_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request | None:
        self._skip_removed()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._skip_removed()
        self._len -= 1
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return (e[3] for e in self._heap if id(e[3]) not in self._removed)

    def snapshot(self) -> list[Request]:
        """The queued requests, safe to take from another thread (C-level copies only)."""
        heap, removed = list(self._heap), set(self._removed)
        return [e[3] for e in heap if id(e[3]) not in removed]


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
        low_priority_step_s: float = 0.0,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 1,
    ) -> None:
        self.kv = kv_cache
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: off
        self.max_long_partial_prefills = max(1, max_long_partial_prefills)
        # Prefill of less important requests (priority above DEFAULT_PRIORITY, the batch class)
        # held to about this much time per step, so a more important request that arrives
        # mid-step waits for at most that much of it; 0 = no limit. Measured, not assumed:
        # the cost per token is learnt from prefill-sized steps (`observe_step`).
        self.low_priority_step_s = low_priority_step_s
        self.seconds_per_token: float | None = None
        self._low_allowance: int | None = None
        self.max_loras = max_loras  # distinct adapters among running requests (None: no limit)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- bookkeeping -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish (stop, length, abort) a request wherever it is and release its blocks."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        self.kv.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Names of the adapters of the running and of the waiting requests (sorted, unique)."""

        def names(requests: list[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))

        return names(list(self.running)), names(self.waiting.snapshot())

    # -- the policy --------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim)
        out.preempted.append(victim)

    @staticmethod
    def _victim_key(r: Request) -> tuple[int, float]:
        # Largest priority value (least important), then the latest arrival.
        return (r.priority, r.arrival_time)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1) Running requests, most important first, so preemption hits the tail. While a
        # more important request has prompt to prefill, less important ones sit this step out
        # (they keep their blocks): its first token does not wait for their decodes.
        self.running.sort(key=self._victim_key)
        self._low_allowance = self._low_priority_allowance()
        urgent = self._urgent_priority()
        deferred: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens <= req.num_computed_tokens:  # nothing to compute (should not happen)
                i += 1
                continue
            if urgent is not None and req.priority > urgent:
                deferred.append(req)
                i += 1
                continue
            if self._cap(req, budget) <= 0:  # a less important request's share of the step is spent
                i += 1
                continue
            s = self._allocate_running(req, budget, scheduled_ids, out)
            if s is None:  # `req` itself was preempted; the list shrank, so `i` now points past it
                continue
            self._take(s, scheduled_ids, out)
            budget -= s.num_new_tokens
            i += 1

        # 2) Waiting requests, unless this step already had to preempt (memory is tight).
        if not out.preempted:
            budget = self._admit_waiting(budget, scheduled_ids, out)

        # 3) The deferred run after all when no more important prefill got into this step
        # (no slot or no blocks for it): they must go on to free what it waits for.
        if deferred and not any(
            s.request.priority <= urgent for s in out.scheduled if self._prefilling(s.request)
        ):
            self._run_deferred(deferred, budget, scheduled_ids, out)
        return out

    def _is_long(self, req: Request) -> bool:
        """Whether `req` has more prompt left to prefill than the long-prefill threshold."""
        t = self.long_prefill_token_threshold
        return t > 0 and req.num_tokens - req.num_computed_tokens > t

    def _long_slots_left(self, priority: int) -> int:
        """Long prompts of `priority` that may start: those as important or more that are
        prefilling take the slots (a less important one is deferred, not in the way)."""
        busy = sum(1 for r in self.running if r.priority <= priority and self._is_long(r))
        return self.max_long_partial_prefills - busy

    def _admit_waiting(self, budget: int, scheduled_ids: set[int], out: SchedulerOutput) -> int:
        """Waiting requests, most important first, while slots, blocks and the budget last;
        the budget left."""
        loras = {r.lora for r in self.running}  # None (the base) among them takes no slot
        skipped: list[Request] = []  # long prompts waiting for a long slot, shorter ones went past
        try:
            return self._admit_in_order(budget, scheduled_ids, out, loras, skipped)
        finally:
            for req in skipped:
                self.waiting.push(req)

    def _admit_in_order(
        self, budget: int, scheduled_ids: set[int], out: SchedulerOutput, loras: set, skipped: list[Request]
    ) -> int:
        threshold = self.long_prefill_token_threshold
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if req is None or self._lora_full(req, loras):  # nothing, or no adapter slot left
                break
            if skipped and (req.priority != skipped[0].priority or len(skipped) >= LONG_LOOKAHEAD):
                break  # only a prompt as important as the long ones it passes goes past them
            hit = PrefixHit()
            # An embedding pools the hidden state of every prompt token: nothing is skipped.
            if req.num_computed_tokens == 0 and not req.pooling:
                hit = self.kv.find_prefix(req, record_stats=False)
            num_computed = hit.num_computed_tokens
            num_new = req.num_tokens - num_computed
            long = threshold > 0 and num_new > threshold
            if long and self._long_slots_left(req.priority) <= 0:
                skipped.append(self.waiting.pop())
                continue
            cap = self._cap(req, budget)
            if long:
                cap = min(cap, threshold)
            if num_new > cap:
                if not self.enable_chunked_prefill or cap <= 0:
                    break
                num_new = cap
            if not self.kv.allocate_slots(req, num_new, hit.block_ids, hit.host_hashes):
                break
            self.waiting.pop()
            if self.kv.enable_caching and req.num_computed_tokens == 0:
                self.kv.stats.record(req.num_tokens, num_computed)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            loras.add(req.lora)
            self.running.append(req)
            self._take(ScheduledRequest(req, num_new), scheduled_ids, out)
            budget -= num_new
        return budget

    def _run_deferred(
        self, deferred: list[Request], budget: int, scheduled_ids: set[int], out: SchedulerOutput
    ) -> None:
        for req in deferred:
            if budget <= 0:
                return
            if (
                req.status != RequestStatus.RUNNING or self._cap(req, budget) <= 0
            ):  # preempted, or share spent
                continue
            s = self._allocate_running(req, budget, scheduled_ids, out)
            if s is None:
                continue
            self._take(s, scheduled_ids, out)
            budget -= s.num_new_tokens

    def _take(self, s: ScheduledRequest, scheduled_ids: set[int], out: SchedulerOutput) -> None:
        out.scheduled.append(s)
        scheduled_ids.add(id(s.request))
        if self._low_allowance is not None and s.request.priority > DEFAULT_PRIORITY:
            self._low_allowance -= s.num_new_tokens

    def _cap(self, req: Request, budget: int) -> int:
        """The most new tokens `req` may take this step."""
        if self._low_allowance is None or req.priority <= DEFAULT_PRIORITY:
            return budget
        return min(budget, self._low_allowance)

    def _low_priority_allowance(self) -> int | None:
        if self.low_priority_step_s <= 0 or self.seconds_per_token is None:
            return None
        return max(1, int(self.low_priority_step_s / self.seconds_per_token))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Learn the cost of a token from a step big enough for prefill to dominate it."""
        if num_tokens < MIN_OBSERVED_TOKENS or seconds <= 0:
            return
        sample = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = sample if prev is None else prev + STEP_COST_ALPHA * (sample - prev)

    @staticmethod
    def _prefilling(req: Request) -> bool:
        return req.num_computed_tokens < req.num_prompt_tokens

    def _urgent_priority(self) -> int | None:
        """The most important priority with prompt left to prefill (a running request's
        chunk, or the head of the queue while a slot is free), when some running request is
        less important; else None (nothing to defer)."""
        if not self.running:
            return None
        least = max(r.priority for r in self.running)
        candidates = [r.priority for r in self.running if self._prefilling(r)]
        head = self.waiting.peek()
        if head is not None and len(self.running) < self.max_num_seqs:
            candidates.append(head.priority)
        urgent = min(candidates, default=None)
        return urgent if urgent is not None and urgent < least else None

    def _allocate_running(
        self, req: Request, budget: int, scheduled_ids: set[int], out: SchedulerOutput
    ) -> ScheduledRequest | None:
        """Blocks for a running request's next chunk (with its speculative drafts when they
        fit), preempting the least important unscheduled others if needed; None when `req`
        itself had to go."""
        cap = self._cap(req, budget)
        if self._is_long(req):
            cap = min(cap, self.long_prefill_token_threshold)
        num_new = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, cap)
        while not self.kv.allocate_slots(req, num_new):
            if req.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                req.spec_token_ids = []
                num_new = min(req.num_tokens - req.num_computed_tokens, cap)
                continue
            victim = max((r for r in self.running if id(r) not in scheduled_ids), key=self._victim_key)
            self._preempt(victim, out)
            if victim is req:
                return None
        num_draft = max(0, req.num_computed_tokens + num_new - req.num_tokens)
        del req.spec_token_ids[num_draft:]  # the budget may cut the drafts short
        return ScheduledRequest(req, num_new, num_draft)

    def _lora_full(self, req: Request, loras: set) -> bool:
        """Whether admitting `req` would need more adapter slots than a step has."""
        return (
            req.lora is not None
            and self.max_loras is not None
            and req.lora not in loras
            and len(loras - {None}) >= self.max_loras
        )

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of every scheduled chunk once the model has computed it."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
