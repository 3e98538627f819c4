"""Fixtures for the store tests: peer processes that are always killed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.store.helpers import Peer


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def spawn(*args: str) -> Peer:
        peer = Peer(*args)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.close()
