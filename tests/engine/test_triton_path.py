"""The engine on the Triton kernels (run by Triton's interpreter on CPU) gives the same greedy
tokens as on the PyTorch reference kernels.

Runs in a child process: Triton reads TRITON_INTERPRET when it is first imported. The model
is a tiny random Llama with SmolLM2's tokenizer (the interpreter is far too slow for 30 layers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: this test's child imports triton; importing it here, at
# collection, would fix this process's Triton mode before tests/kernels can choose it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
from pathlib import Path
from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from engine.model_files.aliases import resolve_model_path
from tests.engine.tiny_checkpoints import make_tiny_hf_checkpoint

out = Path(sys.argv[1])
tok = Tokenizer.from_path(resolve_model_path("smollm2-135m"))
make_tiny_hf_checkpoint(out, vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                        num_layers=2, num_heads=4, num_kv_heads=2, seed=3, max_position_embeddings=512)
tok.backend.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
prompts = [
    "The quick brown fox jumps over the lazy dog, and then " * 3,   # > 2 blocks of 16: crosses boundaries
    "Hello",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
]
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
result = {}
for backend in ("torch", "triton"):
    # A small token budget forces chunked prefill over a cached prefix on the first prompt.
    llm = LLM(str(out), attention_backend=backend, show_progress=False, block_size=16,
              max_num_batched_tokens=24, max_model_len=512)
    result[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print("RESULT " + json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_triton_path_matches_reference_greedy(tmp_path, smollm2_gguf):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "tiny")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert len(result["torch"]) == 3 and all(len(t) == 6 for t in result["torch"])
    assert result["triton"] == result["torch"]
