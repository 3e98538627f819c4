"""The etcd key schema: the one place that knows where each fact lives.

Every key sits under a versioned prefix, ``<root>/v1/``, so a future layout can live beside this one
during an upgrade. ``root`` is configurable (default ``/runwarden``) so several deployments, or several
tests, can share one etcd.

Layout (``N`` = a name, ``#`` = a zero-padded non-negative integer, so lexical order is numeric order)::

    <root>/v1/nodes/N                    node registration, under the agent's lease
    <root>/v1/runs/N/progress/N          per-node aggregated rank progress of a run
    <root>/v1/runs/N/checkpoints/#       committed checkpoints of a run, by step
    <root>/v1/runs/N/stop                a stop request for a run
    <root>/v1/runs/N/attempt             the run's current attempt (fencing for launches)
    <root>/v1/runs/N/spec                the run's spec
    <root>/v1/runs/N/policy              the run's supervisor policy in force (changed live)
    <root>/v1/evidence/N/#               fault evidence reported by a node, by sequence
    <root>/v1/pool/N                     a node's pool membership (spare, active, quarantined)
    <root>/v1/reputation/N               a node's reputation record
    <root>/v1/claims/N                   the run that holds node N now (one run at a time)
    <root>/v1/bids/N/N                   a run's ask for free node N (under its leader's lease)
    <root>/v1/elections/N/               leader-election contenders (one key per contender)

Several runs share one root: each run's controllers (leader + standbys) contend in the run's own
election, ``elections/<run>/`` (``run_election``); nodes, pool entries, reputation and evidence are
the fleet's, shared by every run, and a node's claim says which run may use it now.

Every ``*_prefix()`` ends with "/", so that the prefix of node "a1" never matches node "a10".
"""

from __future__ import annotations

from dataclasses import dataclass

from runwarden.names import check_name

SCHEMA_VERSION = "v1"
DEFAULT_ROOT = "/runwarden"
# The one election of a root before runs had their own (a controller of an older version contends
# here): a newer controller does not lead while one of those does (controller/live/loop.py).
LEGACY_ELECTION = "controller"
# 16 digits hold any step or sequence number a run will ever reach and keep keys short.
NUMBER_DIGITS = 16


def validate_number(number: object, what: str) -> int:
    """Return ``number`` if it is a non-negative int that fits the zero-padded key field."""
    if isinstance(number, bool) or not isinstance(number, int):
        raise ValueError(f"{what} must be an integer, got {type(number).__name__}")
    if number < 0 or number >= 10**NUMBER_DIGITS:
        raise ValueError(f"{what} {number} is outside 0..{10**NUMBER_DIGITS - 1}")
    return number


def validate_root(root: object) -> str:
    """A root is an absolute, slash-separated path of valid names without a trailing slash."""
    if not isinstance(root, str) or not root.startswith("/") or root == "/" or root.endswith("/"):
        raise ValueError(f"key root must look like '/name' or '/a/b' (no trailing '/'), got {root!r}")
    for segment in root[1:].split("/"):
        check_name("key root segment", segment)
    return root


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Builds every key the project stores. Names are validated; bad ones raise ValueError."""

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        validate_root(self.root)

    @property
    def base(self) -> str:
        """``<root>/v1/``: everything this schema version owns."""
        return f"{self.root}/{SCHEMA_VERSION}/"

    def _join(self, *parts: str) -> str:
        return self.base + "/".join(parts)

    # Nodes
    def nodes_prefix(self) -> str:
        return self._join("nodes", "")

    def node(self, name: str) -> str:
        return self._join("nodes", check_name("node name", name))

    # Runs
    def run_prefix(self, run: str) -> str:
        return self._join("runs", check_name("run name", run), "")

    def progress_prefix(self, run: str) -> str:
        return self.run_prefix(run) + "progress/"

    def progress(self, run: str, node: str) -> str:
        return self.progress_prefix(run) + check_name("node name", node)

    def checkpoints_prefix(self, run: str) -> str:
        return self.run_prefix(run) + "checkpoints/"

    def checkpoint(self, run: str, step: int) -> str:
        return self.checkpoints_prefix(run) + _padded(validate_number(step, "checkpoint step"))

    def stop(self, run: str) -> str:
        return self.run_prefix(run) + "stop"

    def attempt(self, run: str) -> str:
        return self.run_prefix(run) + "attempt"

    def spec(self, run: str) -> str:
        return self.run_prefix(run) + "spec"

    def memory(self, run: str) -> str:
        """The supervisor's memory of the run (store_pb2.SupervisorMemory)."""
        return self.run_prefix(run) + "memory"

    def policy(self, run: str) -> str:
        return self.run_prefix(run) + "policy"

    # Evidence, pool, reputation
    def evidence_prefix(self, node: str | None = None) -> str:
        """All evidence, or one node's evidence when ``node`` is given."""
        if node is None:
            return self._join("evidence", "")
        return self._join("evidence", check_name("node name", node), "")

    def evidence(self, node: str, seq: int) -> str:
        return self.evidence_prefix(node) + _padded(validate_number(seq, "evidence sequence"))

    def pool_prefix(self) -> str:
        return self._join("pool", "")

    def pool(self, node: str) -> str:
        return self.pool_prefix() + check_name("node name", node)

    def reputation_prefix(self) -> str:
        return self._join("reputation", "")

    def reputation(self, node: str) -> str:
        return self.reputation_prefix() + check_name("node name", node)

    # Claims: which run holds a node (controller/fleet/claims.py)
    def claims_prefix(self) -> str:
        return self._join("claims", "")

    def claim(self, node: str) -> str:
        return self.claims_prefix() + check_name("node name", node)

    def bids_prefix(self, node: str) -> str:
        """The asks for ``node`` (one key per asking run, ends with '/')."""
        return self._join("bids", check_name("node name", node), "")

    def bid(self, node: str, run: str) -> str:
        return self.bids_prefix(node) + check_name("run name", run)

    # Elections
    def elections_prefix(self) -> str:
        """Every election's contenders (one election per run, plus the legacy "controller")."""
        return self._join("elections", "")

    def election(self, name: str) -> str:
        """The prefix under which contenders for election ``name`` put their keys (ends with '/')."""
        return self._join("elections", check_name("election name", name), "")

    # Parsing
    def name_under(self, prefix: str, key: str) -> str:
        """The single name segment of ``key`` right under ``prefix`` (e.g. the node of a node key).

        Raises ValueError if ``key`` is not directly under ``prefix``.
        """
        if not prefix.endswith("/") or not key.startswith(prefix):
            raise ValueError(f"key {key!r} is not under prefix {prefix!r}")
        return check_name(f"name in key {key!r}", key[len(prefix) :])

    def number_under(self, prefix: str, key: str) -> int:
        """The zero-padded number right under ``prefix`` (a checkpoint step, an evidence sequence)."""
        tail = self.name_under(prefix, key)
        if not tail.isdigit() or len(tail) != NUMBER_DIGITS:
            raise ValueError(f"key {key!r} does not end in a {NUMBER_DIGITS}-digit number")
        return int(tail)


def run_election(run: str) -> str:
    """The election name of run ``run``'s controllers: the run's name (one election per run)."""
    return check_name("run name", run)


def _padded(number: int) -> str:
    return f"{number:0{NUMBER_DIGITS}d}"
