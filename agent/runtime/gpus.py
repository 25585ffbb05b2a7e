"""Which of this host's GPUs each local replica may use (runtime `process`).

CUDA programs start on device 0 unless told otherwise, so without this two replicas on one
host (or two TP=4 replicas on an 8-GPU node) would share GPU 0 (..3). The process runtime
takes `replica_gpu_count` indices per replica from the host's inventory, hands them over as
CUDA_VISIBLE_DEVICES (`cuda_env`), frees them when the replica is gone and claims them
again when a restarted agent adopts it. A host without GPUs (CPU, simulated) has an empty
inventory: nothing is assigned and nothing is set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from agent.runtime.base import InvalidSpec
from agent.runtime.foreign import EngineUnavailable
from fleet_base.engines import parallel_gpus
from fleet_base.protocol import ReplicaSpec

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class GpusUnavailable(EngineUnavailable):
    """Not enough free GPUs on this host now (others' replicas hold them): retried later."""


def replica_gpu_count(spec: ReplicaSpec) -> int:
    """The devices one replica of `spec` spans, in every runtime: its engine's parallel size
    (`fleet_base.engines.parallel_gpus`) or the spec's count, whichever is larger."""
    try:
        return max(spec.resources.gpu_count, parallel_gpus(spec.engine, spec.engine_args))
    except ValueError as err:
        raise InvalidSpec(f"engine_args: {err}") from err


def cuda_env(indices: Sequence[int]) -> dict[str, str]:
    """The environment that confines a process to `indices` (numbered as nvidia-smi numbers
    them: PCI bus order, not CUDA's default fastest-first); empty for none."""
    if not indices:
        return {}
    return {VISIBLE_ENV: ",".join(str(i) for i in indices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def visible_indices(env: Mapping[str, str]) -> list[int] | None:
    """The indices a process environment's CUDA_VISIBLE_DEVICES names; None when it is unset
    or names devices otherwise than by index (UUIDs)."""
    value = env.get(VISIBLE_ENV)
    if value is None:
        return None
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        return None
    return [int(item) for item in items]


class GpuAllocator:
    """Device indices held per replica id: an index is held by at most one replica, and only
    indices of the inventory are handed out."""

    def __init__(self, inventory: Iterable[int]) -> None:
        self.inventory: tuple[int, ...] = tuple(sorted(set(inventory)))
        self._held: dict[str, tuple[int, ...]] = {}

    def held(self) -> dict[str, tuple[int, ...]]:
        return dict(self._held)

    def free(self) -> list[int]:
        taken = {i for devices in self._held.values() for i in devices}
        return [i for i in self.inventory if i not in taken]

    def allocate(self, replica_id: str, count: int) -> tuple[int, ...]:
        """`count` free indices for `replica_id` (lowest first; what it held before is freed
        first: one replica id runs once); () on a host without GPUs. GpusUnavailable when
        fewer are free, InvalidSpec when the host has fewer at all."""
        if not self.inventory:
            return ()
        self.release(replica_id)
        if count > len(self.inventory):
            raise InvalidSpec(f"needs {count} GPUs; this host has {len(self.inventory)}")
        free = self.free()
        if count > len(free):
            raise GpusUnavailable(
                f"needs {count} GPUs; {len(free)} of this host's {len(self.inventory)} are free "
                f"(held: {', '.join(f'{rid} {list(d)}' for rid, d in sorted(self._held.items()))})"
            )
        devices = tuple(free[:count])
        self._held[replica_id] = devices
        return devices

    def claim(self, replica_id: str, indices: Iterable[int]) -> tuple[int, ...]:
        """Hold what an adopted replica already runs on (those of `indices` in the inventory
        and free); returns what was claimed."""
        self.release(replica_id)
        free = set(self.free())
        devices = tuple(i for i in dict.fromkeys(indices) if i in free)
        if devices:
            self._held[replica_id] = devices
        return devices

    def release(self, replica_id: str) -> None:
        self._held.pop(replica_id, None)
