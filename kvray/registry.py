"""Name registries for pluggable policies (prefix cache, attention backend).

A registry maps a name to a factory; CLI choices come from `names()`. Registering a name
twice is an error, so two modules can never silently shadow each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(factory: F) -> F:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return wrap

    def get(self, name: str) -> F:
        try:
            return self._factories[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)
