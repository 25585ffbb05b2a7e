"""Which adapters the engine knows, which sit in device slots, which keep CPU weights.

Three tiers, as in vLLM: registered (by name, any number, each remembering its path),
CPU-resident weights (at most `max_cpu_loras`, least recently used dropped and re-read from
disk when needed) and device slots (at most `max_loras`, least recently used replaced).
The scheduler never runs more distinct adapters in one step than there are slots, so a
step's adapters always fit. Registration runs on any thread (it reads and checks files);
slot assignment runs on the engine thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from engine.lora.batch import LoRABatch
from engine.lora.slots import LoRASlots


def lora_cache_salt(cache_salt: str | None, adapter: LoRAAdapter | None) -> str | None:
    """The prefix-cache salt of a request: its own salt and its adapter's content, so equal
    tokens under another adapter (or the base) never share KV."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{adapter.uid}"


class LoRAManager:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype = dtype
        self.device = device
        self.slots = LoRASlots(cfg, max_loras, max_rank, dtype, device)
        self._lock = threading.Lock()
        self._registry: dict[str, LoRAAdapter] = {}
        self._cpu: OrderedDict[LoRAAdapter, None] = OrderedDict()  # adapters holding CPU weights
        self._device: OrderedDict[LoRAAdapter, int] = OrderedDict()  # adapter -> slot, LRU first
        self.loads_total = 0
        self.slot_loads_total = 0
        self.reread_failures_total = 0

    # -- registry (any thread) -------------------------------------------------------------
    def add(self, name: str, path: str | Path, reserved: Sequence[str] = ()) -> LoRAAdapter:
        """Read, check and register an adapter; a failure changes nothing."""
        if not name or name in reserved:
            raise LoRAAdapterError(f"the name {name!r} is taken by the base model")
        with self._lock:
            if name in self._registry:
                raise LoRAAdapterError(f"an adapter named {name!r} is already loaded")
        adapter = load_peft_adapter(name, path, self.cfg, self.max_rank, self.dtype)
        with self._lock:
            if name in self._registry:  # another caller won the race
                raise LoRAAdapterError(f"an adapter named {name!r} is already loaded")
            self._registry[name] = adapter
            self._keep_cpu(adapter)
            self.loads_total += 1
        return adapter

    def remove(self, name: str) -> LoRAAdapter | None:
        """Forget an adapter; requests already running on it finish on its slot."""
        with self._lock:
            adapter = self._registry.pop(name, None)
            if adapter is not None:
                self._cpu.pop(adapter, None)
            return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._registry.get(name)

    def list(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._registry.values())

    def resident(self) -> list[str]:
        """Names of the registered adapters now in device slots."""
        with self._lock:
            return [a.name for a in self._device if a.name in self._registry]

    def _keep_cpu(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter] = None
        self._cpu.move_to_end(adapter)
        while len(self._cpu) > self.max_cpu_loras:
            old, _ = self._cpu.popitem(last=False)
            old.weights = None  # read again from its path if it is needed later

    # -- slots (engine thread) -------------------------------------------------------------
    def _slot_for(self, adapter: LoRAAdapter, in_step: set[LoRAAdapter]) -> int:
        if adapter in self._device:
            self._device.move_to_end(adapter)
            return self._device[adapter]
        used = set(self._device.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is None:
            victim = next((a for a in self._device if a not in in_step), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than --max-loras {self.max_loras} adapters")
            free = self._device.pop(victim)
        if adapter.weights is None:
            adapter.weights = self._reread(adapter)
        self._keep_cpu(adapter)
        self.slots.write(free, adapter)
        self.slot_loads_total += 1
        self._device[adapter] = free
        return free

    def _reread(self, adapter: LoRAAdapter) -> dict:
        """The weights the CPU tier dropped, from the adapter's files. When they are gone or
        changed the adapter is unregistered (its requests fail alone, later ones are told it
        is not loaded, and whoever placed it can load it again)."""
        try:
            fresh = load_peft_adapter(adapter.name, adapter.path, self.cfg, self.max_rank, self.dtype)
            if fresh.uid != adapter.uid:
                raise LoRAAdapterError("its files changed on disk since it was loaded")
        except LoRAAdapterError as err:
            if self._registry.get(adapter.name) is adapter:
                del self._registry[adapter.name]
            self.reread_failures_total += 1
            raise LoRAAdapterError(f"adapter {adapter.name!r} cannot be read again: {err}") from None
        return fresh.weights

    def prepare(self, adapters: Sequence[LoRAAdapter | None], num_tokens: Sequence[int]) -> LoRABatch | None:
        """The step's LoRA batch (None when no request uses an adapter): every adapter in a
        slot, every flat token (`num_tokens[i]` per request, in batch order) tagged with it."""
        distinct = {a for a in adapters if a is not None}
        if not distinct:
            return None
        with self._lock:
            slot_of = {a: self._slot_for(a, distinct) for a in distinct}
        token_slots: list[int] = []
        for a, n in zip(adapters, num_tokens):
            token_slots.extend([slot_of[a] if a is not None else -1] * n)
        active = frozenset().union(*(a.groups for a in distinct))
        return LoRABatch.build(self.slots, token_slots, active, self.device)
