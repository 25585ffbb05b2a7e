"""Prompt tokens counted with each deployment's own tokenizer, and what the gateway knows
of a deployment from the desired state (its model, its engine arguments).

The model of a deployment comes from `desired.json` (`ReplicaSpec.model`), resolved to
the same files the engine loads (`engine.model_files.aliases`, torch-free: the one alias
table and path rule): an alias names a weights package found without importing it, a URI
is looked up in the node's model cache (never pulled here), anything else is a path. Tokenizers load once
per model (a failure is retried after a minute) through `engine.tokenizer`, torch-free.
When no tokenizer is available the count falls back to the ~4 characters/token estimate;
`counter` says which one counted ("tokenizer" or "estimate").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.gateway.inputs import CHAT_MESSAGE_OVERHEAD, CharEstimate, RequestInfo
from agent.gateway.state import ABSENT, Signature, file_signature
from engine.model_files.aliases import local_model_path
from fleet_base.local_state import LocalState
from fleet_base.protocol import ReplicaSpec

log = logging.getLogger(__name__)

RETRY_FAILED_S = 60.0


def tokenizer_path(model: str) -> Path | None:
    """The .gguf file or Hugging Face directory the engine would load for `model`."""
    return local_model_path(model)


class DesiredIndex:
    """deployment -> a replica spec, and the cluster's jurisdiction, from desired.json,
    reloaded when the file changes."""

    def __init__(self, state_dir: Path) -> None:
        self.local = LocalState(state_dir)
        self._sig: Signature = ABSENT
        self._specs: dict[str, ReplicaSpec] = {}
        self._jurisdiction = ""

    def _reload(self) -> None:
        sig = file_signature(self.local.desired_path)
        if sig == self._sig:
            return
        self._sig = sig
        desired = self.local.load_desired()
        specs: dict[str, ReplicaSpec] = {}
        for r in desired.replicas if desired else []:
            if r.deployment not in specs or r.version > specs[r.deployment].version:
                specs[r.deployment] = r
        self._specs = specs
        self._jurisdiction = desired.jurisdiction if desired else ""

    def spec(self, deployment: str) -> ReplicaSpec | None:
        self._reload()
        return self._specs.get(deployment)

    def jurisdiction(self) -> str:
        """The cluster's own jurisdiction ("" while desired.json names none)."""
        self._reload()
        return self._jurisdiction

    def engine_arg(self, deployment: str, name: str) -> Any:
        spec = self.spec(deployment)
        if spec is None:
            return None
        args = spec.engine_args
        return args.get(name, args.get(name.replace("_", "-")))

    def context_tokens(self, deployment: str, default: int) -> int:
        """The deployment's context window: its engine_args max_model_len, else `default`."""
        value = self.engine_arg(deployment, "max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return default


class TokenCounters:
    """Counts a request's prompt with its deployment's tokenizer (cached per model)."""

    def __init__(self, desired: DesiredIndex, clock: Callable[[], float] = time.monotonic) -> None:
        self.desired = desired
        self.clock = clock
        self._tokenizers: dict[str, Any] = {}
        self._failed: dict[str, float] = {}
        self._loading: dict[str, asyncio.Lock] = {}

    def tokenizer(self, deployment: str) -> Any | None:
        spec = self.desired.spec(deployment)
        if spec is None:
            return None
        model = spec.model
        if model in self._tokenizers:
            return self._tokenizers[model]
        failed = self._failed.get(model)
        if failed is not None and self.clock() - failed < RETRY_FAILED_S:
            return None
        path = tokenizer_path(model)
        try:
            if path is None:
                raise FileNotFoundError(f"no local files for model {model!r}")
            from engine.tokenizer import Tokenizer

            tok = Tokenizer.from_path(path)
        except Exception as err:  # any failure: estimate instead, retry later
            log.warning(
                "deployment %s: no tokenizer for %s (%s); estimating prompt tokens", deployment, model, err
            )
            self._failed[model] = self.clock()
            return None
        self._tokenizers[model] = tok
        return tok

    async def recount_async(self, info: RequestInfo, off_loop: bool = False) -> tuple[RequestInfo, str]:
        """`recount`, loading a tokenizer the first time in a thread (a GGUF's vocabulary
        takes ~0.5 s) so the gateway keeps serving meanwhile; `off_loop` counts in a thread
        too (a large body would hold the event loop for its tokenizing)."""
        spec = self.desired.spec(info.deployment)
        if spec is not None and spec.model not in self._tokenizers:
            lock = self._loading.setdefault(spec.model, asyncio.Lock())
            async with lock:
                if spec.model not in self._tokenizers:
                    await asyncio.to_thread(self.tokenizer, info.deployment)
        if off_loop:
            return await asyncio.to_thread(self.recount, info)
        return self.recount(info)

    def recount(self, info: RequestInfo) -> tuple[RequestInfo, str]:
        """`info` with prompt_tokens counted by the deployment's tokenizer (and, for one
        prompt, its token ids: the prefix router hashes them), and the counter used."""
        tok = self.tokenizer(info.deployment)
        if tok is None:
            return info, "estimate"
        try:
            n, ids = _count(tok, info)
        except Exception as err:  # a template or shape the tokenizer refuses: the replica will say
            log.debug("counting with the tokenizer failed: %s", err)
            return info, "estimate"
        return dataclasses.replace(info, prompt_tokens=n, prompt_ids=ids), "tokenizer"


def _count(tok: Any, info: RequestInfo) -> tuple[int, tuple[int, ...] | None]:
    """Prompt tokens, and the ids of a single prompt (None when there are several or
    the count fell back to per-message estimates)."""
    body = info.body
    if info.endpoint == "chat":
        try:
            kw = {"tools": body["tools"]} if body.get("tools") else {}
            ids = tuple(tok.encode_chat(body["messages"], add_generation_prompt=True, **kw))
            return len(ids), ids
        except Exception:
            total = 0
            for m in body["messages"]:
                content = m.get("content")
                total += CHAT_MESSAGE_OVERHEAD + (
                    len(tok.encode(content, False)) if isinstance(content, str) else 0
                )
            return total, None
    if info.endpoint == "embeddings":  # quotas charge embeddings by their prompt tokens
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        texts = [x for x in inputs if isinstance(x, str)]
        n = sum(len(tok.encode(t, True)) for t in texts) if len(texts) == len(inputs) else info.prompt_tokens
        return n, None
    if info.endpoint == "responses":
        return info.prompt_tokens, None  # estimated from the items; the replica's usage settles it
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True) is not False
    if isinstance(prompt, str):
        ids = tuple(tok.encode(prompt, special))
        return len(ids), ids
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return sum(len(tok.encode(p, special)) for p in prompt), None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return info.prompt_tokens, tuple(prompt)
    return info.prompt_tokens, None  # token ids: already exact


__all__ = ["CharEstimate", "DesiredIndex", "TokenCounters", "tokenizer_path"]
