"""Which requests made a failed step fail: the rest of the batch goes on.

Only used after the model run of a step raised, so the normal path pays nothing. The batch
is split into units that must run together (a request reading KV blocks another one writes
in this very step, as when equal prompts are admitted together), and the units are bisected:
each half is run again on its own, a half that fails is split further, and a unit that
fails alone is the culprit. A failure that no request explains (OOM, a lost device) is not
bisected: it is global, and the caller escalates it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from engine.errors import AdapterUnavailableError, EngineError, StepFailedError, StepInputError
from engine.lora import LoRAAdapterError

T = TypeVar("T")
R = TypeVar("R")

_DEVICE_WORDS = ("CUDA error", "device-side assert", "out of memory", "HIP error", "illegal memory access")


class GlobalStepError(Exception):
    """A run during isolation failed for a reason no request explains."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


def is_global(err: BaseException) -> bool:
    """Whether `err` says the engine, not a request, is broken (memory or the device)."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(err, accel):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err) for w in _DEVICE_WORDS)


def units(block_tables: Sequence[list[int]], written: Sequence[range]) -> list[list[int]]:
    """Indices of the batch grouped into units that must run together: request j joins
    request i when j's blocks include one that i writes this step (`written[i]`, indices
    into i's table)."""
    parent = list(range(len(block_tables)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writer: dict[int, int] = {}
    for i, (table, span) in enumerate(zip(block_tables, written)):
        for block in table[span.start : span.stop]:
            writer.setdefault(block, i)
    for j, table in enumerate(block_tables):
        for block in table:
            i = writer.get(block)
            if i is not None:
                parent[root(j)] = root(i)
    groups: dict[int, list[int]] = {}
    for i in range(len(block_tables)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


@dataclass
class Isolation(Generic[T, R]):
    """The outcome of bisecting a failed batch of `T`s with a `run` that returns `R`s."""

    outputs: list[R] = field(default_factory=list)
    culprits: list[tuple[list[T], BaseException]] = field(default_factory=list)
    ran: bool = False  # some part of the batch ran: the engine itself works
    runs: int = 0


def bisect(
    batch: Sequence[T], groups: list[list[int]], err: BaseException, run: Callable[[list[T]], list[R]]
) -> Isolation[T, R]:
    """Run the halves of `groups` again until each failure is pinned on one unit.
    `run` gets sub-batches in the batch's own order; `GlobalStepError` when a rerun fails
    for a global reason."""
    out: Isolation[T, R] = Isolation()

    def visit(part: list[list[int]], cause: BaseException) -> None:
        if len(part) == 1:
            out.culprits.append(([batch[i] for i in part[0]], cause))
            return
        mid = len(part) // 2
        for half in (part[:mid], part[mid:]):
            sub = [batch[i] for i in sorted(i for unit in half for i in unit)]
            out.runs += 1
            try:
                out.outputs.extend(run(sub))
            except Exception as e:
                if is_global(e):
                    raise GlobalStepError(e) from e
                visit(half, e)
            else:
                out.ran = True

    visit(groups, err)
    return out


def request_error(cause: BaseException) -> EngineError:
    """What the client of a request pinned as a step's culprit is told: an adapter that
    cannot be read again is this replica's problem (503, another may serve it), an input the
    model refused is the client's (400), anything else a server fault for this request only."""
    if isinstance(cause, LoRAAdapterError):
        return AdapterUnavailableError(f"this request's LoRA adapter cannot be used here: {cause}")
    if isinstance(cause, ValueError):
        return StepInputError(f"the engine refused this request's input: {cause}")
    return StepFailedError(f"this request's engine step failed: {cause!r}")
