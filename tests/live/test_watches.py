"""The leader watches disjoint prefixes: every stored change is translated once. (A watch of the run's
whole prefix beside its progress prefix fed each progress write to the core twice: the second copy of
a rank's load mark, arriving after LOAD_DONE, was counted as the first step.)"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from runwarden.store import Store
from tests.live.shell import RUN, agent_double, is_launch, live_shell


def test_no_watched_prefix_holds_another(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watched: list[str] = []
    real = store.watch_prefix

    def spy(prefix: str, *args: Any, **kwargs: Any) -> Any:
        watched.append(prefix)
        return real(prefix, *args, **kwargs)

    monkeypatch.setattr(store, "watch_prefix", spy)
    with agent_double(store), live_shell(store, tmp_path / "run") as (_, log):
        log.wait(is_launch(1), 20)
    k = store.keys
    assert k.progress_prefix(RUN) in watched and k.stop(RUN) in watched and k.policy(RUN) in watched
    overlapping = [(a, b) for a, b in itertools.permutations(set(watched), 2) if b.startswith(a)]
    assert overlapping == []
