"""The state-dict names and shapes the engine expects, in Hugging Face Llama naming."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.model_files.errors import CheckpointError


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must provide, with its torch shape."""
    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def check_state_dict_shapes(
    shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]}{more}")
    extra = [n for n in shapes if n not in expected]
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]} (not used by the engine's Llama model)")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(shapes[name])}, expected {shape} from the config"
            )
