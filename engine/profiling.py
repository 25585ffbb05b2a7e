"""Per-step time split of a live engine, attached from outside (no cost when not attached).

`StepProfiler(engine).attach()` wraps the engine's own stages (scheduler, input building,
sampler, detokenization) and the `forward` methods of the model's modules (embedding,
attention, MLP, norms; instance attributes, gone on detach, so an engine without a profiler
runs its plain methods); the LM head ("logits") is the model's time minus its parts, and
"output handling" is the step's time minus every named stage. Used by
`bench/profile_step.py` and `bench/engine_throughput.py --profile`. "sampling" is the
sampler plus the rest of the runner's `execute` (the per-step sampling batch).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

STAGES = (
    "scheduling",
    "input prep",
    "embedding",
    "attention",
    "mlp",
    "norm",
    "logits",
    "sampling",
    "detok",
    "output handling",
)


class StepProfiler:
    """Accumulates seconds per stage over the steps taken while attached."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._restore: list[Callable[[], None]] = []
        self._cuda = engine.runner.device.type == "cuda"

    # -- timing helpers -----------------------------------------------------------------
    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _wrap(self, owner: Any, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self._now()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] += self._now() - t0

        setattr(owner, name, timed)  # an instance attribute shadows the method until detach
        self._restore.append(lambda o=owner, n=name: o.__dict__.pop(n, None))

    def _hook(self, module: torch.nn.Module, stage: str) -> None:
        """Time `module.forward`: the model calls its submodules' `forward` directly (no
        `nn.Module.__call__`, so no forward hooks fire), and an instance attribute shadows it."""
        self._wrap(module, "forward", stage)

    # -- attach / detach ----------------------------------------------------------------
    def attach(self) -> StepProfiler:
        eng, runner = self.engine, self.engine.runner
        model = runner.model
        self._wrap(eng.scheduler, "schedule", "scheduling")
        self._wrap(runner, "_build_inputs", "input prep")
        self._wrap(eng, "_append_text_and_check_stop", "detok")
        self._wrap(runner, "execute", "_execute")
        self._wrap(eng, "step", "_step")
        self._hook(model, "_model")
        self._hook(model.embed_tokens, "embedding")
        for layer in model.layers:
            self._hook(layer.self_attn, "attention")
            self._hook(layer.mlp, "mlp")
            self._hook(layer.input_layernorm, "norm")
            self._hook(layer.post_attention_layernorm, "norm")
        self._hook(model.norm, "norm")
        self._count_steps()
        return self

    def _count_steps(self) -> None:
        original = self.engine.step

        def counted() -> Any:
            self.steps += 1
            return original()

        self.engine.step = counted

    def detach(self) -> None:
        self.engine.__dict__.pop("step", None)
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    # -- results ------------------------------------------------------------------------
    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step by stage (`STAGES` order) plus "total"."""
        s = self.seconds
        parts = s["embedding"] + s["attention"] + s["mlp"] + s["norm"]
        split = {
            "scheduling": s["scheduling"],
            "input prep": s["input prep"],
            "embedding": s["embedding"],
            "attention": s["attention"],
            "mlp": s["mlp"],
            "norm": s["norm"],
            "logits": max(0.0, s["_model"] - parts),
            # the sampler plus the rest of execute(): building the sampling batch
            "sampling": max(0.0, s["_execute"] - s["input prep"] - s["_model"]),
            "detok": s["detok"],
        }
        split["output handling"] = max(0.0, s["_step"] - sum(split.values()))
        split["total"] = s["_step"]
        n = max(1, self.steps)
        return {k: 1000.0 * v / n for k, v in split.items()}
