"""Llama-family decoder over a flat batch of tokens from many sequences (no padding).

Covers Llama 2/3, SmolLM2, Mistral and Qwen2 (q/k/v biases). Q/K/V and gate/up are fused
into one matmul each: on CPU the number of GEMM calls per layer dominates small models.
Attention reads and writes the paged KV cache through `kernels.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from kernels import ops


@dataclass
class AttentionMetadata:
    """Where each flat token sits in the paged cache; built once per step by the runner.

    Tokens are laid out decodes first (one token per sequence), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    # Decodes in groups of similar context length: (first token, end token, block tables
    # [b, max_blocks] int32, context lens [b] int32). One group on GPU; on the CPU reference
    # path grouping keeps short sequences from paying for the longest one's padding.
    decode_groups: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    prefill_block_tables: torch.Tensor | None  # [Bp, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [Bp+1] int32, relative to the prefill part
    prefill_context_lens: torch.Tensor | None  # [Bp] int32
    lora: Any = None  # engine.lora.LoRABatch of a step with adapters; None = base model only
    # Filled by the model once per forward, shared by its layers (None where the backend needs none).
    rotary: Any = None  # kernels.ops.prepare_rotary
    kv_write: Any = None  # kernels.ops.plan_kv_write
    decode_plans: list[Any] | None = None  # kernels.ops.plan_paged_decode, one per decode group


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden)
        if meta.lora is not None:
            meta.lora.apply(self.layer_idx, "qkv", hidden, qkv)
        n = hidden.shape[0]
        # One head-major view of the fused output; q, k, v (and q with k) are slices of it.
        heads = qkv.view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        q, k, v = heads[:, :q_end], heads[:, q_end:k_end], heads[:, k_end:]
        if meta.rotary is not None:  # query and key heads sit side by side in qkv: one rotation
            ops.rotary_embedding(positions, heads[:, :k_end], None, cos_sin_cache, meta.rotary)
        else:
            ops.rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, meta.kv_write)

        nd = meta.num_decode_tokens
        parts = []
        plans = meta.decode_plans or [None] * len(meta.decode_groups)
        for (start, end, tables, lens), plan in zip(meta.decode_groups, plans):
            parts.append(
                ops.paged_attention_decode(q[start:end], k_cache, v_cache, tables, lens, self.scale, plan)
            )
        if nd < n:
            parts.append(
                ops.paged_attention_prefill(
                    q[nd:],
                    k_cache,
                    v_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_context_lens,
                    self.scale,
                )
            )
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        attn = attn.reshape(n, self.q_size)
        out = self.o_proj.forward(attn)
        if meta.lora is not None:
            meta.lora.apply(self.layer_idx, "o", attn, out)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if lora is not None:
            lora.apply(self.layer_idx, "gate_up", x, gate_up)
        inter = self.intermediate_size
        act = F.silu(gate_up.narrow(-1, 0, inter)).mul_(gate_up.narrow(-1, inter, inter))
        out = self.down_proj.forward(act)
        if lora is not None:
            lora.apply(self.layer_idx, "down", act, out)
        return out


class RMSNormWeight(nn.Module):
    """Holds the weight; the (fused) computation lives in kernels.ops.rms_norm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg, layer_idx)
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        # Submodules by `.forward`, not `__call__`: the hot path skips torch's hook machinery
        # (StepProfiler times these methods by wrapping them, see engine.profiling).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden, meta.lora), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # another weight format's LM head (model.weights_dispatch)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    def init_rope(self, max_position: int) -> None:
        cfg = self.config
        self.cos_sin_cache = ops.build_cos_sin_cache(
            cfg.head_dim,
            max_position,
            cfg.rope_theta,
            cfg.rope_scaling,
            device=self.embed_tokens.weight.device,
            dtype=torch.float32,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        hidden_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns float32 logits for the tokens at `logits_indices` only; with
        `hidden_indices`, also the final (normed) hidden states of those tokens (embeddings)."""
        hidden = self.embed_tokens.forward(input_ids)
        self._plan_step(positions, kv_caches, meta)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer.forward(positions, hidden, residual, kv, meta, self.cos_sin_cache)
        pooled = None
        if hidden_indices is not None:
            pooled, _ = self.norm.forward(
                hidden.index_select(0, hidden_indices), residual.index_select(0, hidden_indices)
            )
        # Only the rows that need a next token go through the final norm and the LM head.
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.norm.forward(hidden, residual)
        if self.logits_head is not None:
            logits = self.logits_head.forward(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        return logits if pooled is None else (logits, pooled.float())

    def _plan_step(
        self,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> None:
        """What every layer of this step would otherwise recompute: rotary angles, decode layouts."""
        if meta.rotary is None:
            meta.rotary = ops.prepare_rotary(positions, self.cos_sin_cache)
        if meta.kv_write is None:
            meta.kv_write = ops.plan_kv_write(meta.slot_mapping)
        if meta.decode_plans is None and kv_caches:
            block_size = kv_caches[0][0].shape[1]
            meta.decode_plans = [
                ops.plan_paged_decode(tables, lens, block_size) for _, _, tables, lens in meta.decode_groups
            ]

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            try:
                return state.pop(name)
            except KeyError:
                raise ValueError(f"checkpoint is missing tensor {name!r}") from None

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        else:
            state.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(
                torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)
            )
            if cfg.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            )
            layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        if state:
            unexpected = ", ".join(sorted(state)[:5])
            raise ValueError(f"checkpoint has {len(state)} unexpected tensor(s): {unexpected}")
