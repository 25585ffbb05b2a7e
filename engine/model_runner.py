"""Turns a scheduler decision into tensors, runs the model and samples.

Owns the model weights and the KV cache tensors; knows nothing about stopping or text.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineArgs, ModelConfig
from engine.continuation import step_seed
from engine.cuda_graphs import DecodeGraphs
from engine.grammar import GrammarBackend
from engine.kv_cache import KvTransfer
from engine.kv_host_buffer import HostKVBuffer
from engine.loader import load_checkpoint
from engine.lora import LoRAManager
from engine.model.llama import AttentionMetadata, LlamaForCausalLM
from engine.model.weights import CPU_ONLY, column_major, convert_linears
from engine.model.weights_choice import apply_auto
from engine.model.weights_dispatch import convert_lm_head
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from engine.scheduler import ScheduledRequest
from engine.spec_decode.rows import SamplingRows
from engine.threads import ThreadPolicy, ThreadTuner, available_cpus
from kernels import ops

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 2 << 30
GPU_MEMORY_UTILIZATION = 0.85
GROUP_RATIO = 1.3  # decode groups on the CPU path: longest / shortest context within a group
MIN_GROUP = 4
PREFILL_VERIFY_MAX = 2  # CPU path: up to this many verified chunks run as prefill chunks


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class ModelRunner:
    def __init__(self, args: EngineArgs, model_path: str) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        ops.set_backend(args.attention_backend)
        t0 = time.perf_counter()
        cfg, state = load_checkpoint(model_path, dtype=self.dtype, show_progress=args.show_progress)
        self.model_config: ModelConfig = cfg
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device=self.device).to(self.dtype)
        for name in list(state):  # in place: the model takes (pops) each tensor and frees it
            state[name] = state[name].to(self.device)
        model.load_hf_state_dict(state)  # so the weights never exist twice in memory
        del state
        if self.device.type == "cpu":
            column_major(model)
        self.weights_plan = "fp32"  # which format serves which batch sizes (startup log, docs)
        self.weights = self._convert_weights(model, args.weights)
        self.model = model.eval()
        self.block_size = args.block_size
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv_cache()
        self.host_kv: HostKVBuffer | None = None
        if self.host_kv_bytes:
            self.host_kv = HostKVBuffer(self._kv_storage, self.host_kv_bytes // self.kv_bytes_per_block)
            log.info(
                "host KV tier: %d blocks in %.2f GiB", self.host_kv.num_slots, self.host_kv_bytes / (1 << 30)
            )
        # A sequence must fit the pool on its own, or it could never be scheduled.
        limit = args.max_model_len or cfg.max_position_embeddings
        self.max_model_len = min(limit, self.num_blocks * self.block_size)
        self.model.init_rope(max(self.max_model_len, cfg.max_position_embeddings))
        self.sampler = Sampler()
        self.lora: LoRAManager | None = None
        if args.enable_lora:
            self.lora = LoRAManager(
                cfg,
                max_loras=args.max_loras,
                max_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras,
                dtype=self.dtype,
                device=self.device,
            )
        self.threads = self._thread_tuner(args.num_threads)
        self.graphs = self._decode_graphs() if args.cuda_graphs else None
        self.grammar: GrammarBackend | None = None  # set by the engine (it owns the tokenizer)
        log.info(
            "model loaded in %.1fs: %s on %s, weights %s, %d KV blocks of %d tokens",
            time.perf_counter() - t0,
            self.dtype,
            self.device,
            self.weights_plan,
            self.num_blocks,
            self.block_size,
        )

    def _convert_weights(self, model: LlamaForCausalLM, fmt: str) -> str:
        """Linear weights in `fmt`; "auto" on CPU with float32: per batch size, the format
        measured fastest here (weights_choice), elsewhere the model's own dtype."""
        if fmt == "auto":
            if self.device.type != "cpu" or self.dtype != torch.float32:
                return "fp32"
            self.weights_plan = apply_auto(model).summary()
            return "auto"
        if fmt in CPU_ONLY and self.device.type != "cpu":
            raise ValueError(f"weights {fmt!r} run on CPU only")
        convert_linears(model, fmt)
        if fmt == "fp16":
            convert_lm_head(model, ((None, "fp16"),))
        self.weights_plan = fmt
        return fmt

    def _decode_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or ops.resolve_backend(self.device) != "triton":
            log.warning("cuda_graphs needs CUDA and the Triton kernels; running eager")
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        return DecodeGraphs(self.model, self.kv_caches, self.args.max_num_seqs, max_blocks, self.device)

    def _thread_tuner(self, pinned: int | None) -> ThreadTuner | None:
        """On CPU: pin the given count, or tune per step among the cores we may use."""
        if self.device.type != "cpu":
            return None
        if pinned is not None:
            torch.set_num_threads(pinned)
            return None
        return ThreadTuner(ThreadPolicy(max_threads=available_cpus()), torch.set_num_threads)

    # -- KV cache ------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem

    @property
    def host_kv_bytes(self) -> int:
        """Bytes of the host tier (`kv_offloading_size_gib`); 0 when it is off."""
        return int(self.args.kv_offloading_size_gib * (1 << 30)) if self.args.enable_prefix_caching else 0

    def copy_kv(self, transfers: list[KvTransfer]) -> None:
        """Move blocks between the device cache and the host tier, before the next step."""
        if transfers:
            assert self.host_kv is not None
            self.host_kv.copy(transfers)

    def _num_blocks(self) -> int:
        if self.args.num_gpu_blocks_override:
            return self.args.num_gpu_blocks_override
        budget = self.args.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * GPU_MEMORY_UTILIZATION) - used
            else:
                budget = DEFAULT_CPU_KV_BYTES
        n = budget // self.kv_bytes_per_block
        if n < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block ({self.kv_bytes_per_block} bytes each)"
            )
        return int(n)

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.model_config
        shape = (c.num_hidden_layers, 2, self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        # On CPU, empty() maps pages lazily, so RSS grows with the blocks actually used rather
        # than the whole budget up front; the kernels never read slots past a context length.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        cache = alloc(shape, dtype=self.dtype, device=self.device)
        self._kv_storage = cache
        return [(cache[i, 0], cache[i, 1]) for i in range(c.num_hidden_layers)]

    # -- one step ------------------------------------------------------------------------
    def _build_inputs(
        self, batch: list[ScheduledRequest], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[tuple[int, int]]]:
        """Flat tokens, decodes first; `batch` is already ordered that way by the caller.

        Also the flat (start, end) rows of each embedding request's chunk (the rows it pools)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        dec_tables, dec_lens = [], []
        pre_tables, pre_lens, pre_qsl = [], [], [0]
        num_decode = 0
        pool_rows: list[tuple[int, int]] = []
        verify_as_decode = self._verify_as_decode(batch)
        for s, blocks in zip(batch, block_ids):
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            if r.pooling:
                pool_rows.append((len(input_ids), len(input_ids) + s.num_new_tokens))
            if s.num_draft_tokens:  # the last real token, then the drafts to verify
                input_ids.extend(r.token_ids_slice(start, end - s.num_draft_tokens))
                input_ids.extend(r.spec_token_ids[: s.num_draft_tokens])
            else:
                input_ids.extend(r.token_ids_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if s.num_new_tokens == 1 or (s.num_draft_tokens and verify_as_decode):
                # A verified chunk as decode rows: row p attends to positions <= p (the
                # chunk's KV is written before attention), one batched call for all of them.
                num_decode += s.num_new_tokens
                dec_tables.extend([blocks] * s.num_new_tokens)
                dec_lens.extend(range(start + 1, end + 1))
            else:
                pre_tables.append(blocks)
                pre_lens.append(end)
                pre_qsl.append(pre_qsl[-1] + s.num_new_tokens)
            if s.samples and not r.pooling:  # a verified chunk samples at every position
                logits_idx.extend(range(len(input_ids) - 1 - s.num_draft_tokens, len(input_ids)))
        dev = self.device

        def table(rows: list[list[int]]) -> torch.Tensor | None:
            if not rows:
                return None
            width = max(len(b) for b in rows)
            padded = [b + [0] * (width - len(b)) for b in rows]
            return torch.tensor(padded, dtype=torch.int32, device=dev)

        def ints(xs: list[int]) -> torch.Tensor | None:
            return torch.tensor(xs, dtype=torch.int32, device=dev) if xs else None

        groups = []
        for start, end in self._decode_groups(dec_lens):
            groups.append((start, end, table(dec_tables[start:end]), ints(dec_lens[start:end])))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=num_decode,
            decode_groups=groups,
            prefill_block_tables=table(pre_tables),
            prefill_query_start_loc=ints(pre_qsl) if pre_tables else None,
            prefill_context_lens=ints(pre_lens),
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            pool_rows,
        )

    def _verify_as_decode(self, batch: list[ScheduledRequest]) -> bool:
        """Lay verified chunks out as decode rows (one batched attention) rather than as
        prefill chunks (one attention call per sequence). On the CPU reference path each
        decode row gathers its whole context, so one or two chunks go the prefill way."""
        n = sum(1 for s in batch if s.num_draft_tokens)
        return n > PREFILL_VERIFY_MAX or (n > 0 and ops.resolve_backend(self.device) != "torch")

    def _decode_groups(self, lens: list[int]) -> list[tuple[int, int]]:
        """Split decodes (sorted by context length) into runs whose lengths differ < GROUP_RATIO.

        The CPU reference gathers every sequence's KV padded to its group's longest one, so
        mixing a 50-token and a 2,000-token sequence would cost 40x for the short one. The
        Triton kernels handle ragged lengths natively: one group.
        """
        if not lens:
            return []
        if ops.resolve_backend(self.device) != "torch":
            return [(0, len(lens))]
        groups, start = [], 0
        for i in range(1, len(lens)):
            if lens[i] > GROUP_RATIO * lens[start] and i - start >= MIN_GROUP:
                groups.append((start, i))
                start = i
        groups.append((start, len(lens)))
        return groups

    def make_generator(self, seed: int) -> torch.Generator:
        """A request's own generator; a seed torch refuses is that request's ValueError."""
        try:
            return torch.Generator(device=self.device).manual_seed(seed)
        except (RuntimeError, ValueError, OverflowError) as err:
            raise ValueError(f"seed {seed} is not usable: {err}") from None

    def _generator(self, s: ScheduledRequest, ahead: int = 0) -> torch.Generator | None:
        """The generator for output index num_output_tokens + `ahead` (verified draft rows)."""
        r = s.request
        seed = r.sampling_params.seed
        if seed is None:
            return None
        # The noise of step k depends on (seed, k) only, so a continuation elsewhere resumes it.
        k = step_seed(seed, r.num_output_tokens + ahead)
        if ahead:
            return self.make_generator(k)
        if r.generator is None:
            r.generator = self.make_generator(seed)
        return r.generator.manual_seed(k)

    @torch.inference_mode()
    def execute(
        self,
        batch: list[ScheduledRequest],
        block_ids: list[list[int]],
        stop_token_ids: list[set[int]],
    ) -> SamplerOutput | None:
        """Run one step; sample for the chunks that reach their last known token.

        `batch` must list decodes (one new token) before prefill chunks, decodes sorted by
        context length (for grouping on the CPU path). Returns None when
        no chunk samples (only partial prefills ran).
        """
        if self.threads is None:
            return self._execute(batch, block_ids, stop_token_ids)
        tokens = sum(s.num_new_tokens for s in batch)
        self.threads.before_step(tokens)
        t0 = time.perf_counter()
        try:
            return self._execute(batch, block_ids, stop_token_ids)
        finally:
            self.threads.after_step(time.perf_counter() - t0, tokens)

    def _execute(
        self,
        batch: list[ScheduledRequest],
        block_ids: list[list[int]],
        stop_token_ids: list[set[int]],
    ) -> SamplerOutput | None:
        input_ids, positions, meta, logits_idx, pool_rows = self._build_inputs(batch, block_ids)
        if self.lora is not None:
            meta.lora = self.lora.prepare([s.request.lora for s in batch], [s.num_new_tokens for s in batch])
        embeddings: dict[str, list[float]] = {}
        if (
            self.graphs is not None
            and not pool_rows
            and self.graphs.applies(meta, input_ids.shape[0], logits_idx.shape[0])
        ):
            logits = self.graphs.run(input_ids, positions, meta)
        elif pool_rows:
            hidden_idx = torch.cat([torch.arange(a, b) for a, b in pool_rows]).to(self.device)
            logits, hidden = self.model(input_ids, positions, self.kv_caches, meta, logits_idx, hidden_idx)
            embeddings = self._pool([s for s in batch if s.request.pooling], pool_rows, hidden)
        else:
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        sampling = [
            (s, stops) for s, stops in zip(batch, stop_token_ids) if s.samples and not s.request.pooling
        ]
        if not sampling:
            return SamplerOutput(token_ids=[], logprobs=None, embeddings=embeddings) if embeddings else None
        rows = SamplingRows.of(sampling, self._generator)
        bitmask = self.grammar.bitmask(rows.grammars) if self.grammar is not None else None
        sbatch = SamplingBatch.build(
            params=rows.params,
            prompt_token_ids=rows.prompt_token_ids,
            output_token_ids=rows.output_token_ids,
            generators=rows.generators,
            stop_token_ids=rows.stop_token_ids,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            token_bitmask=bitmask,
        )
        out = rows.accept(self.sampler(logits, sbatch))
        out.embeddings = embeddings
        return out

    def _pool(
        self, batch: list[ScheduledRequest], rows: list[tuple[int, int]], hidden: torch.Tensor
    ) -> dict[str, list[float]]:
        """Accumulate each embedding request's chunk; finish those whose prompt is complete.

        `hidden` holds the pooled rows of every chunk back to back, in `rows` order."""
        done: dict[str, list[float]] = {}
        at = 0
        for s, (a, b) in zip(batch, rows):
            r = s.request
            chunk = hidden[at : at + (b - a)]
            at += b - a
            p = r.sampling_params.pooling
            assert p is not None
            if r.num_computed_tokens == 0 or r.pool_sum is None:  # first chunk (or recomputed)
                r.pool_sum = torch.zeros(chunk.shape[1], dtype=torch.float32, device=chunk.device)
            if p.pooling == "mean":
                r.pool_sum += chunk.sum(dim=0)
            if not s.samples:
                continue
            vec = chunk[-1] if p.pooling == "last" else r.pool_sum / r.num_prompt_tokens
            if p.normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            done[r.request_id] = vec.tolist()
            r.pool_sum = None
        return done
