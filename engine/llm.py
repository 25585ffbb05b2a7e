"""The offline API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine, PromptInput
from engine.outputs import EngineStats, RequestOutput
from fleet_base.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Runs a batch of prompts to completion with continuous batching."""

    def __init__(self, model: str = "smollm2-135m", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A list of ints is one tokenized prompt. `lora`
        names an adapter (see `add_lora`) for all prompts, or one per prompt (None = base)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            prio = priority[i] if priority is not None else 0
            ids.append(self.engine.add_request(prompt, p, priority=prio, lora_name=loras[i]))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt)
            for c in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                failed = self.engine.take_failures()
                if failed:
                    raise failed[0][1]
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under `name` (needs enable_lora=True)."""
        if self.engine.lora is None:
            raise ValueError("LoRA is not enabled: create the LLM with enable_lora=True")
        self.engine.lora.add(name, path)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()
