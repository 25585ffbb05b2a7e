"""Multi-LoRA: PEFT adapters on one base model, mixed per request within a batch.

`adapter` reads and validates a PEFT directory, `slots` holds the resident adapters stacked
on the device, `manager` is the registry with its LRU tiers, `batch` applies the deltas of a
step's adapters inside the model's projections through `kernels.ops`.
"""

from engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from engine.lora.batch import LoRABatch
from engine.lora.manager import LoRAManager, lora_cache_salt

__all__ = [
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRABatch",
    "LoRAManager",
    "load_peft_adapter",
    "lora_cache_salt",
]
