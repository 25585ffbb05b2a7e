"""A step that fails fails the requests in it, not the engine: the loop goes on serving,
and only repeated failures in a row (a broken engine) stop it."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import AsyncLLM, SamplingParams
from engine.errors import AdapterUnavailableError, EngineDeadError, StepFailedError, UnknownAdapterError

pytestmark = pytest.mark.slow


async def _run(engine: AsyncLLM, prompt: str, max_tokens: int = 4, lora: str | None = None) -> str:
    text = ""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    async for out in engine.generate(prompt, params, lora_name=lora):
        text = out.outputs[0].text
    return text


async def test_failed_step_fails_its_requests_and_the_engine_goes_on(smollm2_gguf):
    engine = AsyncLLM("smollm2-135m", show_progress=False, max_model_len=512)
    try:
        real = engine.engine.runner.execute
        poisoned = {"left": 1}

        def execute(batch, *args, **kwargs):
            if poisoned["left"] and any(
                "poison" in getattr(engine.engine._seq_parent.get(s.request.request_id), "prompt", "")
                for s in batch
            ):
                poisoned["left"] -= 1
                raise RuntimeError("a kernel refused this request's shape")
            return real(batch, *args, **kwargs)

        engine.engine.runner.execute = execute
        with pytest.raises(StepFailedError):
            await _run(engine, "poison pill")
        assert engine.is_running
        assert await _run(engine, "The capital of France is")  # the next request is served
        assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0

        # A seed torch cannot take is refused for that request alone, before any step.
        with pytest.raises(ValueError):
            await _run_seeded(engine, 2**64)
        assert engine.is_running and await _run(engine, "1, 2, 3,")

        # Failures in a row mean a broken engine: the loop dies and says so.
        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        engine.engine.runner.execute = broken
        for _ in range(3):
            with pytest.raises((StepFailedError, EngineDeadError)):
                await _run(engine, "anything")
        assert not engine.is_running
    finally:
        engine.shutdown()


async def _run_seeded(engine: AsyncLLM, seed: int) -> None:
    params = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "seed": seed})
    async for _ in engine.generate("seeded", params):
        pass


def _write_adapter(root: Path, cfg, seed: int) -> Path:
    """A rank-2 PEFT adapter on layer 0's q_proj of the base (a few KB, no peft needed)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    q = cfg.num_attention_heads * cfg.head_dim
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(2, cfg.hidden_size, generator=g) * 0.1,
            f"{prefix}.lora_B.weight": torch.randn(q, 2, generator=g) * 0.1,
        },
        str(root / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


async def test_a_request_whose_adapter_vanished_fails_alone_and_the_batch_goes_on(smollm2_gguf, tmp_path):
    """The node cache evicted an adapter's files after the engine dropped its CPU copy: the
    step that needs it again fails. Only the request on that adapter fails; the base-model
    requests batched with it complete with the tokens they get without it, and three such
    steps in a row leave the replica up."""
    engine = AsyncLLM(
        "smollm2-135m", show_progress=False, max_model_len=512, enable_lora=True, max_loras=1, max_cpu_loras=1
    )
    try:
        cfg = engine.model_config
        real, failed_with = engine.engine.runner.execute, []

        def execute(batch, *args, **kwargs):  # records the size of every step that failed
            try:
                return real(batch, *args, **kwargs)
            except Exception:
                failed_with.append(len(batch))
                raise

        engine.engine.runner.execute = execute
        prompts = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
        want = await asyncio.gather(*(_run(engine, p, 6) for p in prompts))
        for i in range(3):  # three such steps in a row
            gone = _write_adapter(tmp_path / f"gone{i}", cfg, 1)
            await engine.add_lora(f"gone{i}", str(gone))
            kept = _write_adapter(tmp_path / f"kept{i}", cfg, 2)
            await engine.add_lora(f"kept{i}", str(kept))  # the one CPU copy: gone's weights dropped
            shutil.rmtree(gone)
            got = await asyncio.gather(
                *(_run(engine, p, 6) for p in prompts),
                _run(engine, "Tell me a story", 6, lora=f"gone{i}"),
                return_exceptions=True,
            )
            assert got[:3] == want, got
            assert isinstance(got[3], AdapterUnavailableError) and f"gone{i}" in str(got[3]), got[3]
            assert max(failed_with) > 1, failed_with  # it failed in a step shared with others
            failed_with.clear()
        assert engine.is_running
        assert engine.engine.step_failures["escalated"] == 0
        # The adapter that cannot be read is no longer offered; the others still serve.
        assert "gone0" not in [a.name for a in engine.list_loras()]
        with pytest.raises(UnknownAdapterError):
            await _run(engine, prompts[0], 6, lora="gone0")
        assert await _run(engine, prompts[0], 6, lora="kept2")
        assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0
    finally:
        engine.shutdown()
