"""Metric collectors built once per registry: a second app on the same service (tests,
reloads) reuses them instead of failing on a duplicate registration."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry

T = TypeVar("T")


class PerRegistry(Generic[T]):
    """``PerRegistry(build)(registry)``: ``build(registry)`` the first time, the same after."""

    def __init__(self, build: Callable[[CollectorRegistry], T]) -> None:
        self._build = build
        self._by_registry: weakref.WeakKeyDictionary[CollectorRegistry, T] = weakref.WeakKeyDictionary()

    def __call__(self, registry: CollectorRegistry) -> T:
        collectors = self._by_registry.get(registry)
        if collectors is None:
            collectors = self._build(registry)
            self._by_registry[registry] = collectors
        return collectors
