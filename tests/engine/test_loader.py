"""Checkpoint loading: the real SmolLM2 GGUF against transformers, tiny round trips, clear errors.

Over ~400 lines: GGUF and safetensors cases share the tiny checkpoint writers and the
real-model fixture.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.loader import CheckpointError, CheckpointNotFoundError, load_checkpoint, read_model_config
from engine.loader.rope_scaling import llama3_factors, llama3_scaling_from_factors
from engine.model_files.gguf import GGUFFile
from tests.engine.tiny_checkpoints import make_tiny_gguf, make_tiny_hf_checkpoint, quantize_like_gguf

LLAMA3_TINY = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small enough that several of the 8 frequencies of head_dim 16 fall in the blended band
    "original_max_position_embeddings": 64,
}


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def hf_gguf_reference(hf_smollm2):
    """transformers' own GGUF loading of SmolLM2: the state dict and config to match."""
    return hf_smollm2.state_dict(), hf_smollm2.config


@pytest.mark.slow
def test_real_gguf_matches_transformers(smollm2_gguf: Path, hf_gguf_reference) -> None:
    ref_state, ref_cfg = hf_gguf_reference
    cfg, state = load_checkpoint(smollm2_gguf)

    # Tied: transformers exposes lm_head.weight as the embedding; the engine omits it.
    assert set(state) == set(ref_state) - {"lm_head.weight"}
    assert torch.equal(ref_state["lm_head.weight"], ref_state["model.embed_tokens.weight"])
    for name, ref in ref_state.items():
        if name == "lm_head.weight":
            continue
        got = state[name]
        assert got.dtype == torch.float32 and got.device.type == "cpu", name
        assert got.shape == ref.shape, name
        # Both dequantize the same blocks with gguf's numpy code: equal, bar float noise.
        assert torch.equal(got, ref) or float((got - ref).abs().max()) <= 1e-6, name

    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.head_dim == 64 and cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.rope_scaling is None and not cfg.attention_bias
    ref_theta = getattr(ref_cfg, "rope_parameters", None) or {"rope_theta": ref_cfg.rope_theta}
    assert cfg.rope_theta == ref_theta["rope_theta"]
    assert cfg.num_hidden_layers == ref_cfg.num_hidden_layers
    assert cfg.hidden_size == ref_cfg.hidden_size
    assert cfg.intermediate_size == ref_cfg.intermediate_size
    assert cfg.num_attention_heads == ref_cfg.num_attention_heads
    assert cfg.num_key_value_heads == ref_cfg.num_key_value_heads
    assert cfg.vocab_size == ref_cfg.vocab_size == 49152
    assert cfg.max_position_embeddings == ref_cfg.max_position_embeddings
    assert cfg.tie_word_embeddings == ref_cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)
    assert read_model_config(smollm2_gguf) == cfg


def test_gguf_header_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    """Our fast header walk sees what gguf.GGUFReader sees: every value type, tensor bytes."""
    path = tmp_path / "all-types.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for kind, value in [
        ("uint8", 7),
        ("int8", -7),
        ("uint16", 700),
        ("int16", -700),
        ("uint32", 70000),
        ("int32", -70000),
        ("uint64", 2**40),
        ("int64", -(2**40)),
        ("float32", 1e-5),
        ("float64", 0.1),
        ("bool", True),
        ("string", "héllo ✓"),
    ]:
        getattr(w, f"add_{kind}")(f"test.{kind}", value)
    w.add_array("test.tokens", [f"tok{i} ✓" for i in range(3000)] + [""])
    w.add_array("test.ints", list(range(-5, 500)))
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.bools", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal(17).astype(np.float32))
    q8, _ = quantize_like_gguf(rng.standard_normal((6, 64)), "Q8_0")
    w.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", rng.standard_normal((3, 5, 7)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == keys
        for key in keys:
            ref, got = reader.fields[key].contents(), f.metadata[key]
            if isinstance(got, float):
                assert got == pytest.approx(ref, rel=1e-6), key
            elif isinstance(got, np.ndarray):
                assert np.array_equal(got, np.asarray(ref)), key
            else:
                assert got == ref, key
        assert f.metadata["test.float32"] == 1e-5  # shortest float32 decimal, as in config.json
        assert f.metadata["test.tokens"][3] == "tok3 ✓"
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = f.tensors[t.name]
            assert info.qtype == t.tensor_type and info.offset == t.data_offset, t.name
            assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
            assert np.array_equal(f.raw(info), t.data.view(np.uint8).reshape(info.byte_shape)), t.name


# ---------------------------------------------------------------- tiny checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_hf_checkpoint(root / "llama", rope_scaling=LLAMA3_TINY, seed=0),
        "qwen2": make_tiny_hf_checkpoint(
            root / "qwen2",
            model_type="qwen2",
            tie=True,
            num_kv_heads=1,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            rope_theta=50000.0,
            seed=1,
        ),
        "sharded": make_tiny_hf_checkpoint(root / "sharded", max_shard_size="200KB", seed=2),
        "mistral": make_tiny_hf_checkpoint(root / "mistral", model_type="mistral", tie=True, seed=3),
    }


def _hf_reference(path: Path) -> tuple[dict[str, torch.Tensor], object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state, model.config


def _assert_config_matches_hf(cfg: ModelConfig, hf_cfg) -> None:
    assert cfg.vocab_size == hf_cfg.vocab_size
    assert cfg.hidden_size == hf_cfg.hidden_size
    assert cfg.intermediate_size == hf_cfg.intermediate_size
    assert cfg.num_hidden_layers == hf_cfg.num_hidden_layers
    assert cfg.num_attention_heads == hf_cfg.num_attention_heads
    assert cfg.num_key_value_heads == hf_cfg.num_key_value_heads
    assert cfg.head_dim == hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)
    assert cfg.max_position_embeddings == hf_cfg.max_position_embeddings
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    assert cfg.rope_theta == rope.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    rope.pop("rope_theta", None)
    expected = None if rope.get("rope_type", "default") == "default" else rope
    assert cfg.rope_scaling == expected


@pytest.mark.parametrize("kind", ["llama", "qwen2", "sharded", "mistral"])
def test_hf_directory_round_trip(tiny: dict[str, Path], kind: str) -> None:
    path = tiny[kind]
    ref_state, hf_cfg = _hf_reference(path)
    cfg, state = load_checkpoint(path)
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), name
    _assert_config_matches_hf(cfg, hf_cfg)
    assert cfg.architecture == ("llama" if kind == "sharded" else kind)
    assert cfg.attention_bias == (kind == "qwen2")
    assert read_model_config(path) == cfg
    if kind == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1


def test_hf_directory_dtype_and_llama3_rope(tiny: dict[str, Path]) -> None:
    cfg, state = load_checkpoint(tiny["llama"], dtype=torch.bfloat16)
    assert cfg.rope_scaling == LLAMA3_TINY
    assert "lm_head.weight" in state and not cfg.tie_word_embeddings
    _, ref = load_checkpoint(tiny["llama"])
    for name, t in state.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, ref[name].to(torch.bfloat16)), name


# Relative to each tensor's largest magnitude: half a quantization step, or a full step where
# the format clips the extreme value (Q4_0 / Q5_0 scale by the signed maximum).
QTYPE_TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 4e-3,
    "Q8_0": 5e-3,
    "Q5_1": 0.035,
    "Q5_0": 0.07,
    "Q4_1": 0.07,
    "Q4_0": 0.13,
}


@pytest.mark.parametrize("qtype", list(QTYPE_TOLERANCE))
def test_tiny_gguf_round_trip(tiny: dict[str, Path], tmp_path: Path, qtype: str) -> None:
    """Weights come back un-permuted, in HF names and shapes, equal to what the blocks encode."""
    hf_cfg, hf_state = load_checkpoint(tiny["llama"])
    path = make_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", tiny["llama"], qtype)
    cfg, state = load_checkpoint(path)

    assert cfg == hf_cfg  # every number, the llama3 scaling included, survives the metadata
    assert set(state) == set(hf_state)
    for name, orig in hf_state.items():
        got = state[name]
        assert got.shape == orig.shape and got.dtype == torch.float32, name
        if orig.ndim == 2 and qtype != "F32":
            data, gtype = quantize_like_gguf(orig.numpy(), qtype)
            expected = torch.from_numpy(gguf.quants.dequantize(data, gtype).astype(np.float32))
        else:
            expected = orig
        assert torch.equal(got, expected), name
        err = (got - orig).abs().max() / orig.abs().max()
        assert err <= QTYPE_TOLERANCE[qtype], (name, float(err))


def test_tiny_gguf_qwen2_biases_tied_linear_rope(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Qwen2 GGUFs are not Q/K-permuted, carry q/k/v biases, and here tie the embeddings."""
    hf_cfg, hf_state = load_checkpoint(tiny["qwen2"])
    path = make_tiny_gguf(tmp_path / "qwen2.gguf", tiny["qwen2"], "F32")
    cfg, state = load_checkpoint(path)
    assert cfg == hf_cfg
    assert cfg.attention_bias and cfg.tie_word_embeddings and cfg.num_key_value_heads == 1
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert "lm_head.weight" not in state and "model.layers.1.self_attn.k_proj.bias" in state
    assert set(state) == set(hf_state)
    for name, orig in hf_state.items():
        assert torch.equal(state[name], orig), name


def test_tiny_gguf_mistral_is_written_as_llama(tiny: dict[str, Path], tmp_path: Path) -> None:
    hf_cfg, hf_state = load_checkpoint(tiny["mistral"])
    cfg, state = load_checkpoint(make_tiny_gguf(tmp_path / "m.gguf", tiny["mistral"], "F16"))
    assert cfg == hf_cfg.model_copy(update={"architecture": "llama"})
    for name, orig in hf_state.items():
        torch.testing.assert_close(state[name], orig, rtol=1e-3, atol=1e-4, msg=name)


def test_gguf_dtype_and_progress_bar(tiny: dict[str, Path], tmp_path: Path, capsys) -> None:
    path = make_tiny_gguf(tmp_path / "bf16.gguf", tiny["llama"], "BF16")
    _, ref = load_checkpoint(path)
    _, half = load_checkpoint(path, dtype=torch.float16, show_progress=True)
    assert "Loading weights" in capsys.readouterr().err
    for name, t in half.items():
        assert t.dtype == torch.float16 and torch.equal(t, ref[name].half()), name
    _, quiet = load_checkpoint(path, dtype=torch.bfloat16)
    assert capsys.readouterr().err == ""
    # BF16 blocks read as bfloat16 lose nothing (1-D tensors are stored as F32).
    for name, t in quiet.items():
        if t.ndim == 2:
            assert torch.equal(t.float(), ref[name]), name


@pytest.mark.parametrize(
    ("head_dim", "theta", "factor", "orig"),
    [(128, 500000.0, 8.0, 8192), (64, 500000.0, 32.0, 8192), (16, 10000.0, 8.0, 64)],
)
def test_llama3_scaling_recovered_from_rope_freqs(
    head_dim: int, theta: float, factor: float, orig: int
) -> None:
    """Llama 3.1 / 3.2 numbers survive llama.cpp's per-frequency factors (stored as float32)."""
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": orig,
    }
    factors = llama3_factors(head_dim, theta, scaling).astype(np.float32)
    assert llama3_scaling_from_factors(factors, head_dim, theta, orig) == scaling
    with pytest.raises(CheckpointError, match="llama3"):
        llama3_scaling_from_factors(factors[::-1].copy(), head_dim, theta, orig)


def test_head_dim_other_than_hidden_over_heads(tmp_path: Path) -> None:
    """head_dim 32 with hidden 64 and 4 heads: Q has 128 rows; GGUF records attention.key_length."""
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", head_dim=32, num_layers=1, seed=4)
    hf_cfg, hf_state = load_checkpoint(hf)
    assert hf_cfg.head_dim == 32 and hf_state["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    cfg, state = load_checkpoint(make_tiny_gguf(tmp_path / "hd.gguf", hf, "F32"))
    assert cfg == hf_cfg
    for name, orig in hf_state.items():
        assert torch.equal(state[name], orig), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_k_quant_blocks_dequantize_to_row_major_shape(tmp_path: Path, qtype: str) -> None:
    """256-wide super-blocks (which gguf cannot quantize, only read) come back as [rows, cols]."""
    from engine.loader.gguf import _dequantize

    gtype = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[gtype]
    rows, cols = 3, 2 * block_size
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    path = _write_gguf(tmp_path / "k.gguf", "llama", {"w.weight": (raw, gtype)})
    with GGUFFile(path) as f:
        info = f.tensors["w.weight"]
        assert info.shape == (rows, cols)
        got = _dequantize(f, info)
    assert got.shape == (rows, cols)
    # random bytes may hold inf/NaN f16 scales: compare NaN-aware
    assert np.array_equal(got, gguf.quants.dequantize(raw, gtype), equal_nan=True)


# ---------------------------------------------------------------- errors


def _write_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]
) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path: Path) -> None:
    embd = (np.zeros((8, 32), np.float32), gguf.GGMLQuantizationType.F32)
    path = _write_gguf(tmp_path / "phi.gguf", "phi3", {"token_embd.weight": embd})
    with pytest.raises(CheckpointError, match=r"architecture 'phi3' is not supported"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="phi3"):
        read_model_config(path)


def test_unsupported_model_type_in_config_json(tiny: dict[str, Path], tmp_path: Path) -> None:
    text = (
        (tiny["llama"] / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    )
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2' is not supported"):
        load_checkpoint(tmp_path)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((8, 32 // block_size * type_size), np.uint8)
    path = _write_gguf(
        tmp_path / "q81.gguf", "llama", {"token_embd.weight": (raw, gguf.GGMLQuantizationType.Q8_1)}
    )
    with pytest.raises(CheckpointError, match=r"token_embd\.weight.*Q8_1"):
        load_checkpoint(path)


def test_missing_paths(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.gguf", tmp_path / "nope"):
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            load_checkpoint(path)
        with pytest.raises(FileNotFoundError):
            read_model_config(path)
    with pytest.raises(CheckpointNotFoundError, match=r"without config\.json"):
        load_checkpoint(tmp_path)


def test_missing_weight_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    state = load_file(tiny["llama"] / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path)


def test_corrupt_files(tiny: dict[str, Path], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint(empty)

    good = make_tiny_gguf(tmp_path / "good.gguf", tiny["llama"], "Q8_0").read_bytes()
    for cut in (30, len(good) // 2, len(good) - 100):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(good[:cut])
        with pytest.raises(CheckpointError, match=r"truncated|past the end"):
            load_checkpoint(truncated)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        load_checkpoint(hf)
    (hf / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_model_config(hf)
