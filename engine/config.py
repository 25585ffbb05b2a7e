"""Model architecture numbers and the engine's user-facing knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.spec_decode.config import DEFAULT_SPECULATIVE_CONFIG, SpeculativeConfig


class ModelConfig(BaseModel):
    """Architecture of a Llama-family decoder, read from GGUF metadata or config.json."""

    model_config = ConfigDict(frozen=True)

    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases


AttentionBackend = Literal["auto", "torch", "triton"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Weights = Literal["fp32", "fp16", "bf16", "int8", "int4", "auto"]


class EngineArgs(BaseModel):
    """Knobs a user sets on `LLM(...)`, `AsyncLLM(...)` or `python -m engine.server`."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m"
    tokenizer: str | None = None  # defaults to the model's own files
    dtype: DType = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    block_size: int = Field(16, ge=1)
    kv_cache_memory: int | None = Field(None, ge=1)  # bytes for the KV pool; None: a default budget
    num_gpu_blocks_override: int | None = Field(None, ge=1)  # exact pool size (tests use it)
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_prefix_caching: bool = True
    # Host-memory tier below the KV pool (vLLM's --kv-offloading-size, in GiB; 0 = off): evicted
    # prefix blocks are kept there and loaded back on a hit instead of recomputed.
    kv_offloading_size_gib: float = Field(0.0, ge=0.0)
    enable_chunked_prefill: bool = True
    # vLLM's flags: a prompt with more than this many tokens left to prefill is long, takes at
    # most this many of a step's tokens while shorter prompts want them, and at most
    # `max_long_partial_prefills` long prompts prefill at once (0 = off: first come, first served).
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_long_partial_prefills: int = Field(1, ge=1)
    # Prefill of less important (batch-class) requests per step, in seconds of measured work:
    # an interactive request arriving mid-step waits at most about this long for it; 0 = no limit.
    low_priority_step_s: float = Field(0.02, ge=0.0, le=10.0)
    max_queue_len: int = Field(4096, ge=1)  # waiting requests beyond this are refused
    # AsyncLLM: output a request's consumer has not read yet (estimated bytes) beyond which
    # the request is aborted and its KV blocks freed: a client that stops reading costs
    # the replica at most this, not everything the request could still generate.
    max_unread_bytes: int = Field(4 << 20, ge=1024)
    attention_backend: AttentionBackend = "auto"
    seed: int = 0
    # Linear-layer weight format (docs/engine.md "Weights"): auto = per batch size, the format
    # measured fastest at load on CPU with float32; elsewhere (CUDA) the model dtype's.
    weights: Weights = "auto"
    # torch intra-op threads: None = chosen per step by measurement among the cores this
    # process may use (engine.threads); a number pins it.
    num_threads: int | None = Field(None, ge=1)
    # CUDA with the Triton kernels: replay decode-only steps from captured graphs (engine.cuda_graphs)
    cuda_graphs: bool = False
    show_progress: bool = True
    # Multi-LoRA (vLLM's flags): adapters in device slots at once, their largest rank, and
    # how many keep CPU weights (default: max_loras) before they are re-read from disk.
    enable_lora: bool = False
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    # Speculative decoding (vLLM's name and fields): {"method": "ngram", "num_speculative_tokens": 5,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4} (the default:
    # on, gated); None = off (docs/engine.md has the measurement behind the default).
    speculative_config: SpeculativeConfig | None = DEFAULT_SPECULATIVE_CONFIG

    @model_validator(mode="after")
    def _long_prefill_cap(self) -> EngineArgs:
        threshold = self.long_prefill_token_threshold
        if threshold and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold needs chunked prefill (a long prompt is prefilled in chunks)"
            )
        if threshold and threshold >= self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_token_threshold ({threshold}) must be below max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), or 0"
            )
        return self
