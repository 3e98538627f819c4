"""A separate process holding store state, for tests that must kill (SIGKILL) or pause (SIGSTOP) it.

Usage: ``python -m tests.store.peer keeper ENDPOINT KEY TTL`` puts KEY under a kept-alive lease and
prints ``READY``; ``python -m tests.store.peer contender ENDPOINT ELECTION VALUE TTL`` campaigns,
prints ``LEADER <fence>`` when it wins, then obeys stdin lines ``put KEY VALUE`` (a fenced put,
answered ``WROTE <revision>`` or ``REFUSED <message>``).
"""

from __future__ import annotations

import sys
import time

from runwarden.store import NotLeader, Store, StoreConfig


def _say(line: str) -> None:
    print(line, flush=True)


def keeper(endpoint: str, key: str, ttl_s: float) -> None:
    store = Store.connect(StoreConfig(endpoints=(endpoint,)))
    lease = store.grant_lease(ttl_s)
    store.put(key, b"alive", lease=lease)
    keeper = store.keep_alive(lease)
    _say(f"READY {lease.id}")
    while not keeper.lost.wait(1.0):
        pass
    _say(f"LOST {keeper.reason}")


def contender(endpoint: str, election: str, value: str, ttl_s: float) -> None:
    store = Store.connect(StoreConfig(endpoints=(endpoint,)))
    _say("CAMPAIGNING")
    leadership = store.campaign(election, value.encode(), ttl_s=ttl_s, timeout_s=60.0)
    _say(f"LEADER {leadership.fence}")
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["put"] and len(words) == 3:
            try:
                revision = store.fenced_put(words[1], words[2].encode(), leadership)
            except NotLeader as err:
                _say(f"REFUSED {err}")
            else:
                _say(f"WROTE {revision}")
    time.sleep(0.1)


def main() -> None:
    role, endpoint, *rest = sys.argv[1:]
    if role == "keeper":
        keeper(endpoint, rest[0], float(rest[1]))
    elif role == "contender":
        contender(endpoint, rest[0], rest[1], float(rest[2]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
