"""GPU quotas per priority class: a bound (`max_gpus`: the class never grows past it, so
critical work is bounded) and a floor (`min_gpus`: the class is placed up to it before
any other class takes free capacity, and is never preempted below it, so batch work
cannot starve). Both placers enforce them inside placement (FFD as checks in its loop,
the MILP as rows); this module is the one home of their meaning.

Quotas bound growth, they do not evict: a class that already runs more than `max_gpus`
(the quota was lowered) keeps what runs and gets no more until it is under the bound.

The fleet setting is `FLEET_GPU_QUOTAS`, e.g. `critical:max=16,batch:min=4` (classes
separated by `,` or `;`, each `class:key=N[:key=N]`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from control_plane.placement.base import PRIORITY_RANK, Assignment, PriorityClass, ReplicaDemand


class ClassQuota(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    min_gpus: int = Field(0, ge=0, le=1_000_000)
    max_gpus: int | None = Field(None, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _ordered(self) -> ClassQuota:
        if self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus {self.min_gpus} is above max_gpus {self.max_gpus}")
        return self


class GpuQuotas(BaseModel):
    """Quotas by class; a class not named has neither bound nor floor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    classes: dict[PriorityClass, ClassQuota] = Field(default_factory=dict)

    def floor(self, priority: str) -> int:
        q = self.classes.get(priority)  # type: ignore[call-overload]
        return q.min_gpus if q else 0

    def bound(self, priority: str) -> int | None:
        q = self.classes.get(priority)  # type: ignore[call-overload]
        return q.max_gpus if q else None

    def __bool__(self) -> bool:
        return any(q.min_gpus or q.max_gpus is not None for q in self.classes.values())

    def fingerprint(self) -> tuple:
        return tuple(sorted((c, q.min_gpus, q.max_gpus) for c, q in self.classes.items()))


NO_QUOTAS = GpuQuotas()


def parse_quotas(text: str) -> GpuQuotas:
    """`critical:max=16,batch:min=4` -> GpuQuotas; ValueError with the reason."""
    classes: dict[str, dict[str, int]] = {}
    for part in (p.strip() for p in text.replace(";", ",").split(",")):
        if not part:
            continue
        name, _, rest = part.partition(":")
        name = name.strip()
        if name not in PRIORITY_RANK:
            raise ValueError(f"{part!r}: unknown class {name!r} (one of {', '.join(PRIORITY_RANK)})")
        if name in classes:
            raise ValueError(f"{part!r}: class {name!r} given twice")
        fields: dict[str, int] = {}
        for item in (i.strip() for i in rest.split(":") if i.strip()):
            key, _, value = item.partition("=")
            key = {"min": "min_gpus", "max": "max_gpus"}.get(key.strip(), key.strip())
            if key not in ("min_gpus", "max_gpus") or not value.strip().isdigit():
                raise ValueError(f"{part!r}: expected min=N or max=N, got {item!r}")
            fields[key] = int(value)
        if not fields:
            raise ValueError(f"{part!r}: give min=N and/or max=N")
        classes[name] = fields
    return GpuQuotas.model_validate({"classes": classes})


def running_gpus(demands: Iterable[ReplicaDemand], stayable: Mapping[tuple[str, int], int]) -> dict[str, int]:
    """GPUs each class runs now and may keep: per demand, min(wanted, running replicas
    that could stay) x its GPUs. A bound is never below this (quotas do not evict)."""
    out: dict[str, int] = defaultdict(int)
    for d in demands:
        out[d.priority] += d.gpu_count * min(d.count, stayable.get(d.key, 0))
    return out


def class_caps(quotas: GpuQuotas, running: Mapping[str, int]) -> dict[str, int]:
    """GPUs each bounded class may hold after the plan."""
    return {
        c: max(q.max_gpus, running.get(c, 0)) for c, q in quotas.classes.items() if q.max_gpus is not None
    }


def preemptible(quotas: GpuQuotas, running: Mapping[str, int]) -> dict[str, int]:
    """GPUs of each floored class a plan may preempt: what runs above its floor."""
    return {c: max(0, running.get(c, 0) - q.min_gpus) for c, q in quotas.classes.items() if q.min_gpus}


def quota_reason(priority: str, quotas: GpuQuotas, held: int) -> str:
    return f"quota: class {priority} holds {held} GPU(s), max_gpus {quotas.bound(priority)}"


def held_by_class(
    assignments: Iterable[Assignment], rank_of: Mapping[tuple[str, int], str]
) -> dict[str, int]:
    """GPUs per class in a plan (`rank_of`: demand key -> class)."""
    out: dict[str, int] = defaultdict(int)
    for a in assignments:
        c = rank_of.get((a.deployment, a.version))
        if c is not None:
            out[c] += a.gpus
    return out
