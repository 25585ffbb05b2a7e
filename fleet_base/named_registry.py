"""Name -> factory registries: placers, autoscaling policies, routing policies.

One small helper so each kind of pluggable policy registers, lists and builds the same
way, with the same error for an unknown name. Torch-free and dependency-free: the gateway
and the control plane both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Mapping[str, Callable[[], T]], Generic[T]):
    """Factories by name. `make(name)` builds one; an unknown name is a ValueError that
    lists the known ones (callers turn it into a 4xx or a CLI error)."""

    def __init__(self, kind: str, factories: Mapping[str, Callable[[], T]] | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[[], T]] = dict(factories or {})

    def register(self, name: str, factory: Callable[[], T]) -> None:
        self._factories[name] = factory

    def make(self, name: str) -> T:
        try:
            factory = self._factories[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None
        return factory()

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __getitem__(self, name: str) -> Callable[[], T]:
        return self._factories[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)
