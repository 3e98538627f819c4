"""The `SetTimer` rules, kept once for every shell (live controller, simulator, test driver).

`set(key, at)` replaces any pending timer with the same key; `pop_due(now)` removes and returns the
due ones, earliest first (a shell then delivers one `Tick` at or after each); `next_at()` is the
earliest pending time, for a loop's sleep or a simulator's event heap. Late is fine, early is
harmless: the core re-checks its own deadlines on every tick.
"""

from __future__ import annotations


class Timers:
    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def set(self, key: str, at: float) -> bool:
        """Arm `key` at `at`; False when it was already armed at exactly that time (nothing new)."""
        if self._at.get(key) == at:
            return False
        self._at[key] = at
        return True

    def is_current(self, key: str, at: float) -> bool:
        """Whether `key` is still armed at `at` (a simulator's heap entry may have been replaced)."""
        return self._at.get(key) == at

    def get(self, key: str) -> float | None:
        return self._at.get(key)

    def items(self) -> list[tuple[str, float]]:
        """(key, at) pairs, earliest first."""
        return sorted(self._at.items(), key=lambda kv: (kv[1], kv[0]))

    def pop(self, key: str) -> None:
        self._at.pop(key, None)

    def pop_due(self, now: float) -> list[tuple[float, str]]:
        due = sorted((at, key) for key, at in self._at.items() if at <= now)
        for _, key in due:
            del self._at[key]
        return due

    def next_at(self) -> float | None:
        return min(self._at.values(), default=None)

    def clear(self) -> None:
        self._at.clear()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at
