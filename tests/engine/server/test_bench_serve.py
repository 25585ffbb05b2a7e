"""Keeps bench/serve.py working: its client loop against the shared real server, tiny sizes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import serve
from bench.inputs import load_sharegpt_prompts
from engine.server.process import ServerProcess
from tests.engine.server.conftest import MODEL

pytestmark = pytest.mark.slow


def test_pick_prompts_respects_the_token_limit(shared_data: Path, server: ServerProcess) -> None:
    from engine.model_files.aliases import resolve_model_path
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model_path(MODEL))
    texts = load_sharegpt_prompts(shared_data / "sharegpt_v3_filtered_500.json")
    picked = serve.pick_prompts(texts, tok, 3, 64)
    assert len(picked) == 3 and all(n <= 64 for _, n in picked)
    with pytest.raises(ValueError, match="only"):
        serve.pick_prompts(texts[:5], tok, 10, 64)


def test_run_level_measures_streamed_requests(shared_data: Path, server: ServerProcess, capsys) -> None:
    prompts = ["Say hello.", "Name a color.", "Count to three."]
    ticks: list[int] = []
    res = asyncio.run(serve.run_level(server.url, MODEL, prompts, 3, concurrency=2, tick=ticks.append))
    assert res.num_requests == 3 and res.errors == 0 and sum(ticks) == 3
    assert res.output_tokens == 3 * 3  # ignore_eos: exactly max_tokens each
    assert 0 < res.ttft_p50 <= res.ttft_p99 and 0 < res.itl_p50 <= res.itl_p99
    assert res.tokens_per_s > 0
    offline = serve.OfflineResult(num_requests=3, output_tokens=9, seconds=res.seconds / 2)
    serve.print_results([res], [offline], caption="test")
    out = capsys.readouterr().out
    assert "offli" in out and "0.5" in out
