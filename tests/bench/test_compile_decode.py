"""The torch.compile evaluation's piecewise decode forward, run eager, is the model's forward.

No compile here (tens of seconds per bucket): only that the pieces the benchmark compiles
compute what the engine computes, on a tiny random checkpoint through the real engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.compile_decode import PiecewiseDecode, capture_decode_inputs
from tests.engine.tiny_checkpoints import make_tiny_hf_checkpoint


def test_pieces_eager_equal_the_model_forward_on_a_decode_step(tmp_path: Path, smollm2_gguf: Path) -> None:
    from engine import LLM
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_gguf)
    out = make_tiny_hf_checkpoint(
        tmp_path / "tiny", vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, seed=7
    )
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    llm = LLM(
        str(out),
        show_progress=False,
        num_threads=1,
        weights="fp32",
        block_size=16,
        max_model_len=256,
        kv_cache_memory=8 << 20,
    )
    for batch in (1, 3):  # one row (a view over its blocks), and rows of different lengths
        (input_ids, positions, kv, meta, idx), ids = capture_decode_inputs(
            llm, batch, [list(range(40, 40 + 20 + 9 * i)) for i in range(batch)]
        )
        with torch.inference_mode():
            want = llm.engine.runner.model(input_ids, positions, kv, meta, idx)
            meta.rotary = meta.kv_write = meta.decode_plans = None
            got = PiecewiseDecode(llm.engine.runner.model)(input_ids, positions, kv, meta, idx)
        assert got.shape == (batch, tok.vocab_size)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        for rid in ids:
            llm.engine.abort_request(rid)
        llm.engine.step()
