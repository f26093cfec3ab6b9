"""Routing strategies: pick node(s) of one role among the healthy ones.

Invariants: a strategy only chooses among the nodes it is given (the healthy ones, in
registration order); `choose_many(nodes, k)` returns `min(k, len(nodes))` distinct nodes.
Strategies are per role, so each role's round-robin cursor advances independently.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from epd.proxy.config import ROLES
from epd.proxy.registry import Node


class Router(Protocol):
    name: str

    def choose(self, nodes: Sequence[Node]) -> Node | None: ...

    def choose_many(self, nodes: Sequence[Node], k: int) -> list[Node]: ...


class _CursorRouter:
    """Shared by the cursor-based strategies: `choose` is `choose_many(nodes, 1)`."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, nodes: Sequence[Node]) -> Node | None:
        picked = self.choose_many(nodes, 1)
        return picked[0] if picked else None

    def choose_many(self, nodes: Sequence[Node], k: int) -> list[Node]:
        raise NotImplementedError


class RoundRobin(_CursorRouter):
    name = "round_robin"

    def choose_many(self, nodes: Sequence[Node], k: int) -> list[Node]:
        if not nodes or k <= 0:
            return []
        start = self._cursor % len(nodes)
        self._cursor += 1
        return [nodes[(start + i) % len(nodes)] for i in range(min(k, len(nodes)))]


class LeastLoaded(_CursorRouter):
    """Fewest in-flight requests through this proxy; ties go round-robin."""

    name = "least_loaded"

    def choose_many(self, nodes: Sequence[Node], k: int) -> list[Node]:
        if not nodes or k <= 0:
            return []
        n = len(nodes)
        start = self._cursor % n
        self._cursor += 1
        order = sorted(range(n), key=lambda i: (nodes[i].in_flight, (i - start) % n))
        return [nodes[i] for i in order[: min(k, n)]]


class RandomChoice:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, nodes: Sequence[Node]) -> Node | None:
        return self._rng.choice(list(nodes)) if nodes else None

    def choose_many(self, nodes: Sequence[Node], k: int) -> list[Node]:
        if not nodes or k <= 0:
            return []
        return self._rng.sample(list(nodes), min(k, len(nodes)))


STRATEGY_CLASSES: dict[str, type] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "random": RandomChoice,
}


def make_router(name: str) -> Router:
    try:
        return STRATEGY_CLASSES[name]()
    except KeyError:
        raise ValueError(
            f"unknown routing strategy {name!r}; choose {sorted(STRATEGY_CLASSES)}"
        ) from None


def make_routers(strategy_for_role) -> dict[str, Router]:
    """One router per role; `strategy_for_role(role) -> strategy name`."""
    return {role: make_router(strategy_for_role(role)) for role in ROLES}
