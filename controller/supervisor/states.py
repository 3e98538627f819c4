"""The run's states, and the two errors of the state machine (controller/supervisor/machine.py)."""

from __future__ import annotations

import enum


class RunState(enum.Enum):
    WAITING_NODES = "waiting_nodes"
    PREFLIGHT = "preflight"
    RUNNING = "running"
    COLLECTING = "collecting"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    CONTROL_PLANE = "control_plane"
    COMPLETED = "completed"
    CRASH_LOOP = "crash_loop"
    BUDGET_EXHAUSTED = "budget_exhausted"
    STOPPED = "stopped"


TERMINAL = frozenset({RunState.COMPLETED, RunState.CRASH_LOOP, RunState.BUDGET_EXHAUSTED, RunState.STOPPED})
LIVE = frozenset(RunState) - TERMINAL
IN_ATTEMPT = frozenset({RunState.RUNNING, RunState.COLLECTING, RunState.STOPPING})


class TransitionError(RuntimeError):
    """An event the state machine has no rule for in its current state (raised before anything changes)."""


class IllegalTransition(AssertionError):
    """A handler tried a move the table does not allow: a bug; the core may be half-changed."""
