"""A step that fails fails the requests in it, not the engine: the loop goes on serving,
and only repeated failures in a row (a broken engine) stop it."""

from __future__ import annotations

import pytest

from engine import AsyncLLM, SamplingParams
from engine.errors import EngineDeadError, StepFailedError

pytestmark = pytest.mark.slow


async def _run(engine: AsyncLLM, prompt: str, max_tokens: int = 4) -> str:
    text = ""
    async for out in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        text = out.outputs[0].text
    return text


async def test_failed_step_fails_its_requests_and_the_engine_goes_on(smollm2_gguf):
    engine = AsyncLLM("smollm2-135m", show_progress=False, max_model_len=512)
    try:
        real = engine.engine.runner.execute
        poisoned = {"left": 1}

        def execute(batch, *args, **kwargs):
            if poisoned["left"] and any(
                "poison" in (engine.engine._seq_parent[s.request.request_id].prompt or "") for s in batch
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
