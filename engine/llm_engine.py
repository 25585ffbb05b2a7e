"""The synchronous engine: add requests, `step()` until done.

One step = schedule -> run the model on the flat batch -> append sampled tokens ->
detokenize incrementally -> check stops -> free finished sequences. A request with
`n > 1` becomes n sequences that share the prompt (and, through the prefix cache, its KV).

The step loop and its per-sequence bookkeeping (stops, detokenization, grammar) share
state; scheduling, sampling, the model run, failure isolation and output building
(`engine.sequences`) are their own modules.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from engine.config import EngineArgs
from engine.continuation import check_resume, prime
from engine.errors import EngineError, PromptTooLongError, QueueFullError, UnknownAdapterError
from engine.grammar import GrammarBackend
from engine.kv_cache import HostTier, KVCacheManager, KvEventLog
from engine.lora import LoRAAdapter, LoRAManager, lora_cache_salt
from engine.model_files.aliases import resolve_model_path
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput, SampleLogprobs
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.sequences import ParentRequest, SequenceState, make_output
from engine.spec_decode.decoder import SpeculativeDecoder
from engine.step_isolation import GlobalStepError, bisect, is_global, request_error, units
from engine.timing import DurationHistogram, HistogramSnapshot
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from fleet_base.sampling_params import SamplingParams, generation_limit

log = logging.getLogger(__name__)

KV_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

PromptInput = str | list[int]


def _batch_order(s: ScheduledRequest) -> tuple[int, int]:
    kind = 0 if s.num_new_tokens == 1 else 1 if s.num_draft_tokens else 2
    return kind, s.request.num_computed_tokens if kind < 2 else 0


class _CommitError(Exception):
    """Committing a step's results failed after the model ran (it cannot be run again)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class StepError(Exception):
    """A step failed; `request_ids` were in it (the others are untouched)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"a step of {len(request_ids)} request(s) failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        model_path = resolve_model_path(args.model)
        self.tokenizer = Tokenizer.from_path(args.tokenizer or model_path)
        self.runner = ModelRunner(args, str(model_path))
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        # KV events: what the prefix cache holds, for prefix-aware routing (server /kv/events)
        self.kv_events = KvEventLog(args.block_size)
        host = None
        if self.runner.host_kv is not None:  # the host tier: evicted prefix blocks kept in host memory
            host = HostTier(self.runner.host_kv_bytes, self.runner.kv_bytes_per_block, self.kv_events)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            events=self.kv_events,
            host_tier=host,
        )
        self.kv_load_seconds = DurationHistogram(KV_LOAD_BUCKETS)  # per step that loads host blocks
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, args.block_size),
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_loras=args.max_loras if args.enable_lora else None,
            low_priority_step_s=args.low_priority_step_s,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_long_partial_prefills=args.max_long_partial_prefills,
        )
        spec = args.speculative_config
        self.spec = SpeculativeDecoder(spec, self.max_model_len) if spec is not None else None
        self._parents: dict[str, ParentRequest] = {}
        self._seq_parent: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._failures: list[tuple[str, EngineError]] = []
        self.step_failures = {"isolated": 0, "recovered": 0, "escalated": 0}
        # Test hook (POST /debug/corrupt): each sampled token is replaced by the next id, as
        # a silent device fault would garble answers while the process looks healthy.
        self.corrupt = False

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend, built on first use (any thread)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size)
                self.runner.grammar = self._grammar
            return self._grammar

    def grammar_timings(self) -> dict[str, HistogramSnapshot]:
        g = self._grammar
        return (
            {} if g is None else {"compile": g.compile_seconds.snapshot(), "mask": g.mask_seconds.snapshot()}
        )

    # -- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        stream: bool = False,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prompt_text: str | None = None,
        resume_token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Queue a request; `prompt_text` labels outputs when the caller tokenized already.
        `resume_token_ids`: continue a generation that produced these (engine.continuation);
        `lora_name` runs it under that loaded adapter."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in flight")
        adapter = self.lora_adapter(lora_name)
        cache_salt = lora_cache_salt(cache_salt, adapter)
        ids = self.tokenize_prompt(prompt)
        max_tokens = generation_limit(params.max_tokens, len(ids), self.max_model_len)
        if params.max_tokens is None and max_tokens < 1:
            raise PromptTooLongError(len(ids), 1, self.max_model_len)
        if len(ids) + max_tokens > self.max_model_len:
            raise PromptTooLongError(len(ids), max_tokens, self.max_model_len)
        if len(self.scheduler.waiting) + params.n > self.args.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.args.max_queue_len} requests)")
        if params.pooling is not None and params.n != 1:
            raise ValueError("an embedding request has exactly one sequence (n = 1)")
        if params.structured is not None:
            self.grammar.compile(params.structured)  # cached; raises GrammarError (a ValueError)
        if resume_token_ids:
            check_resume(params, resume_token_ids, self.model_config.vocab_size)

        arrival = arrival_time if arrival_time is not None else time.monotonic()
        parent = ParentRequest(
            request_id, prompt if isinstance(prompt, str) else prompt_text, ids, params, stream, arrival
        )
        if params.seed is not None:  # here, so a bad seed fails this request only
            self.runner.make_generator(params.seed + params.n - 1)
        base_stops = set() if params.ignore_eos else set(self.tokenizer.stop_token_ids)
        stop_ids = base_stops | set(params.stop_token_ids)
        for j in range(params.n):
            child_params = params.model_copy(
                update={
                    "n": 1,
                    "max_tokens": max_tokens,
                    "seed": None if params.seed is None else params.seed + j,
                }
            )
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{j}",
                prompt_token_ids=ids,
                sampling_params=child_params,
                priority=priority,
                arrival_time=arrival,
                cache_salt=cache_salt,
                lora=adapter,
                eos_token_id=self.tokenizer.eos_token_id,
                max_model_len=self.max_model_len,
            )
            if params.structured is not None:
                req.grammar = self.grammar.matcher(params.structured)
            if child_params.seed is not None:
                req.generator = self.runner.make_generator(child_params.seed)
            seq = SequenceState(
                request=req,
                index=j,
                detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prefix_ids=ids[-8:]),
                stop_ids=stop_ids,
                logprobs=[] if params.logprobs is not None else None,
            )
            if resume_token_ids:
                prime(seq, resume_token_ids)
            parent.seqs.append(seq)
            self._seq_parent[req.request_id] = parent
            self.scheduler.add_request(req)
        self._parents[request_id] = parent
        self.prompt_tokens_total += len(ids)
        return request_id

    # -- LoRA adapters -------------------------------------------------------------------
    @property
    def lora(self) -> LoRAManager | None:
        return self.runner.lora

    def lora_adapter(self, name: str | None) -> LoRAAdapter | None:
        """The loaded adapter called `name` (None for None); unknown names raise."""
        if name is None:
            return None
        adapter = self.lora.get(name) if self.lora is not None else None
        if adapter is None:
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs:
            self.scheduler.finish_request(seq.request, RequestStatus.FINISHED_ABORTED)
        return self._finish_parent(parent)

    def fail_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort these requests (a step they were in failed); their final outputs. The blocks
        the step was to fill leave the prefix cache: no later request may read them."""
        outs = []
        for rid in dict.fromkeys(request_ids):
            for seq in self._parents[rid].seqs if rid in self._parents else ():
                self.kv.forget_uncomputed(seq.request)
            out = self.abort_request(rid)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. When the model run fails, the requests that made it fail are found
        (`engine.step_isolation`), failed alone (`take_failures`) and the rest run; a
        failure no request explains raises `StepError` naming every request of the step."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        # Decodes first, then verified speculative chunks, shortest context first, then
        # prefill chunks: the runner lays flat tokens out that way.
        batch = sorted(sched.scheduled, key=_batch_order)
        try:
            self._move_kv()
        except Exception as err:  # a copy between tiers failed: nothing the step reads is sound
            raise self._escalate(batch, err) from err
        try:
            started = time.perf_counter()
            outputs = self._run(batch)
            self.scheduler.observe_step(sched.num_tokens, time.perf_counter() - started)
            return outputs
        except _CommitError as err:  # the model ran: nothing can be run again
            raise self._escalate(batch, err.cause) from err.cause
        except Exception as err:
            return self._isolate(batch, err)

    def _move_kv(self) -> None:
        """Copy blocks between the device cache and the host tier, as the last scheduling
        queued them, before any step can overwrite an offloaded block or read a loaded one."""
        transfers = self.kv.take_transfers()
        if not transfers:
            return
        t0 = time.perf_counter()
        try:
            self.runner.copy_kv(transfers)
        except Exception:
            self.kv.abandon_transfers(transfers)
            raise
        if any(t.kind == "load" for t in transfers):
            self.kv_load_seconds.observe(time.perf_counter() - t0)
        self.kv.transfers_done(transfers)

    def take_failures(self) -> list[tuple[str, EngineError]]:
        """Requests the last step failed alone (request id, the error for its client)."""
        failed, self._failures = self._failures, []
        return failed

    def _run(self, batch: list[ScheduledRequest]) -> list[RequestOutput]:
        """Run the model on `batch`; on success commit its results (`_CommitError` if that fails)."""
        seqs = [self._seq_state(s.request) for s in batch]
        result = self.runner.execute(
            batch, [self.kv.get_block_ids(s.request.request_id) for s in batch], [q.stop_ids for q in seqs]
        )
        try:
            return self._commit(batch, result)
        except Exception as err:
            raise _CommitError(err) from err

    def _escalate(self, batch: list[ScheduledRequest], cause: BaseException) -> StepError:
        self.step_failures["escalated"] += 1
        ids = [
            self._seq_parent[s.request.request_id].request_id
            for s in batch
            if s.request.request_id in self._seq_parent
        ]
        return StepError(ids, cause)

    def _isolate(self, batch: list[ScheduledRequest], err: BaseException) -> list[RequestOutput]:
        """The failed run again in parts, to fail only the requests it cannot run with."""
        if is_global(err):
            raise self._escalate(batch, err) from err
        bs = self.kv.block_size
        tables = [self.kv.get_block_ids(s.request.request_id) for s in batch]
        written = [
            range(
                s.request.num_computed_tokens // bs,
                -(-(s.request.num_computed_tokens + s.num_new_tokens) // bs),
            )
            for s in batch
        ]
        try:
            found = bisect(batch, units(tables, written), err, self._run)
        except GlobalStepError as g:
            raise self._escalate(batch, g.cause) from g.cause
        except _CommitError as c:
            raise self._escalate(batch, c.cause) from c.cause
        if not found.ran and not self._probe():
            raise self._escalate(batch, err) from err
        failed: dict[str, EngineError] = {}
        for unit, cause in found.culprits:
            log.warning(
                "a step failed for request(s) %s alone: %r", [s.request.request_id for s in unit], cause
            )
            for s in unit:
                failed.setdefault(self._seq_parent[s.request.request_id].request_id, request_error(cause))
        self.step_failures["isolated" if failed else "recovered"] += 1
        self.fail_requests(list(failed))
        self._failures.extend(failed.items())
        return [o for o in found.outputs if o.request_id not in failed]

    def _probe(self) -> bool:
        """Whether the model runs at all: one token of the base model, in a block of its own."""
        probe = Request(
            request_id="\x00probe", prompt_token_ids=[0], sampling_params=SamplingParams(max_tokens=1)
        )
        if not self.kv.allocate_slots(probe, 1):
            return False
        try:
            self._move_kv()  # the probe's block may have been a cached one to offload
            self.runner.execute(
                [ScheduledRequest(probe, 1)], [self.kv.get_block_ids(probe.request_id)], [set()]
            )
        except Exception as err:
            log.error("the engine cannot run a one-token probe: %r", err)
            return False
        finally:
            self.kv.free(probe)
        return True

    def _commit(self, batch: list[ScheduledRequest], result) -> list[RequestOutput]:
        """Advance the batch past this step and turn its sampled tokens into outputs."""
        sampling: list[ScheduledRequest] = [s for s in batch if s.samples and not s.request.pooling]
        self.scheduler.update_after_step(SchedulerOutput(batch))
        if result is None:
            return []

        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        for s in batch:
            vec = result.embeddings.get(s.request.request_id) if s.request.pooling else None
            if vec is not None:
                s.request.embedding = vec
                s.request.first_token_time = s.request.last_token_time = now
                self.scheduler.finish_request(s.request, RequestStatus.FINISHED_STOPPED)
                parent = self._seq_parent[s.request.request_id]
                touched[parent.request_id] = parent
        if result.logprobs is not None:
            self._fill_logprob_texts([lp for lp in result.logprobs if lp is not None])
        at = 0
        for j, s in enumerate(sampling):
            req = s.request
            seq = self._seq_state(req)
            n = 1 if result.counts is None else result.counts[j]
            for row in range(at, at + n):  # several with speculation: stop at the first stop
                if self._append_token(seq, result, row, now) is not None:
                    break
            at += n
            if self.spec is not None and s.num_draft_tokens:
                accepted = result.accepted[j] if result.accepted is not None else 0
                self.spec.after_verify(req, s.num_draft_tokens, accepted, self.kv)
            parent = self._seq_parent[req.request_id]
            touched[parent.request_id] = parent

        outputs = []
        for parent in touched.values():
            if parent.finished:
                outputs.append(self._finish_parent(parent))
            elif parent.stream:
                outputs.append(make_output(parent))
        return outputs

    def _append_token(self, seq: SequenceState, result, row: int, now: float) -> RequestStatus | None:
        """Append the sampled token of `row`; finish the sequence if it stops there."""
        req = seq.request
        token = result.token_ids[row]
        if self.corrupt:
            token = (token + 1) % self.model_config.vocab_size
        req.append_output_token(token)
        self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        if seq.logprobs is not None and result.logprobs is not None and result.logprobs[row] is not None:
            seq.logprobs.append(result.logprobs[row])
        status = self._append_text_and_check_stop(seq, token)
        if req.grammar is not None and status is None:
            status = self._advance_grammar(seq, token)
        if status is not None:
            self.scheduler.finish_request(req, status)
        return status

    def _seq_state(self, req: Request) -> SequenceState:
        parent = self._seq_parent[req.request_id]
        return parent.seqs[0] if len(parent.seqs) == 1 else next(q for q in parent.seqs if q.request is req)

    def _fill_logprob_texts(self, lps: list[SampleLogprobs]) -> None:
        ids = [lp.sampled.token_id for lp in lps] + [t.token_id for lp in lps for t in lp.top]
        texts = iter(self.tokenizer.token_texts(ids))
        for lp in lps:
            lp.sampled.token = next(texts)
        for lp in lps:
            for t in lp.top:
                t.token = next(texts)

    def _append_text_and_check_stop(self, seq: SequenceState, token: int) -> RequestStatus | None:
        req, p = seq.request, seq.request.sampling_params
        if token in seq.stop_ids and req.num_output_tokens >= p.min_tokens:
            # The stop token's text is not part of the output (vLLM / OpenAI semantics).
            req.stop_reason = None if token == self.tokenizer.eos_token_id else token
            seq.text += seq.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        before = len(seq.text)
        seq.text += seq.detok.push([token])
        if p.stop and len(seq.text) > before:
            window_start = max(0, before - p.max_stop_len + 1)
            hit = self._find_stop(seq.text, window_start, p.stop)
            if hit is not None:
                pos, stop = hit
                seq.text = seq.text[: pos + len(stop) if p.include_stop_str_in_output else pos]
                req.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= (p.max_tokens or 0) or req.num_tokens >= self.max_model_len:
            seq.text += seq.detok.flush()
            return RequestStatus.FINISHED_LENGTH
        return None

    def _advance_grammar(self, seq: SequenceState, token: int) -> RequestStatus | None:
        """Feed the sampled token to the sequence's grammar; a completed grammar ends it."""
        m = seq.request.grammar
        if not m.accept_token(token):  # cannot happen with the mask applied; never loop on it
            log.warning("request %s: token %d left its grammar", seq.request.request_id, token)
            seq.text += seq.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        if m.is_terminated():
            seq.text += seq.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        return None

    @staticmethod
    def _find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in stops:
            i = text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _finish_parent(self, parent: ParentRequest) -> RequestOutput:
        out = make_output(parent)
        del self._parents[parent.request_id]
        for seq in parent.seqs:
            self._seq_parent.pop(seq.request.request_id, None)
        return out

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        running_loras, waiting_loras = self.scheduler.lora_adapters()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks_total=self.kv.num_blocks,
            prefix_cache_queries=self.kv.stats.prefix_cache_queries,
            prefix_cache_hits=self.kv.stats.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            spec_decode_num_drafts=self.spec.num_drafts if self.spec is not None else 0,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens if self.spec is not None else 0,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens if self.spec is not None else 0,
            spec_decode_num_gated_steps=self.spec.num_gated_steps if self.spec is not None else 0,
            spec_decode_num_backoff_skips=self.spec.num_backoff_skips if self.spec is not None else 0,
            step_failures=dict(self.step_failures),
            kv_tier_hits=dict(self.kv.tier_stats.hits),
            kv_tier_bytes=dict(self.kv.tier_stats.bytes),
            kv_tier_load_seconds=self.kv_load_seconds.snapshot() if self.kv.host is not None else None,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            max_loras=self.scheduler.max_loras or 0,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
