"""What the engine reports as it works: the observer protocol (barrel.metrics implements
it) and the one that ignores everything. Called in the engine thread only."""

from __future__ import annotations

from typing import Protocol

from barrel.engine.types import Done


class EngineObserver(Protocol):
    """Receives the engine's measurements, in the engine thread (see barrel.metrics)."""

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, done: Done) -> None: ...

    def drafted(self, drafted: int, accepted: int) -> None:
        """Speculative decoding: draft tokens verified in a step, and how many were kept."""

    def forced(self, tokens: int) -> None:
        """A grammar's forced tokens decoded in a step without sampling (fast-forward)."""

    def next_turn(self, tokens: int) -> None:
        """A finished sequence was extended with its template's next-turn tokens."""

    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        """After every turn of the loop that did work, decoded or not (a cancelled
        sequence ends without a decode). `busy_cells`: those of running sequences."""


class NoObserver:
    """An observer that records nothing (tests, benches)."""

    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        pass

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def finished(self, done: Done) -> None:
        pass

    def drafted(self, drafted: int, accepted: int) -> None:
        pass

    def forced(self, tokens: int) -> None:
        pass

    def next_turn(self, tokens: int) -> None:
        pass
