"""The life of one parked group as the agent sees it: states, events and the pure transition between
them (no process, pipe or clock here; nodeagent.warm.groups applies it, the golden scripts in
tests/nodeagent/warm_scripts/ drive it line by line).

    STARTING --ready--> PARKED --hand-off--> RUNNING --end--> LEAVING
       |                  ^                     |                |
       failed             +------ended <code>---+----------------+
       v
    FAILED          any state --gone / closed--> DEAD

STARTING: the leader imports torch and forks its ranks. PARKED: every rank said ready (or parked again
after an attempt): a launch may take it. RUNNING: a hand-off was written, an attempt runs on its
ranks. LEAVING: the agent asked the ranks to leave the attempt (`end`) and park again. FAILED: it
exited before it was ready (it never ran anything; the owner starts another after a back-off).
DEAD: its leader exited or the agent closed it; it runs nothing again. `ended <code>` while an
attempt runs is the attempt's end with every rank parked again (the same processes serve the next
attempt; when ranks died in it, `replacing` before it and `ready <pids>` after it bracket their
replacement, during which the PARKED group takes no launch: not a change of state); `gone` while
one runs is the attempt's end without them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ParkedState(enum.Enum):
    STARTING = "starting"
    PARKED = "parked"
    RUNNING = "running"
    LEAVING = "leaving"
    FAILED = "failed"
    DEAD = "dead"


class ParkedEvent(enum.Enum):
    READY = "ready"  # the leader's `ready <pids>`
    FAILED = "failed"  # the leader exited (or said something else) before it was ready
    HAND_OFF = "hand-off"  # the agent wrote a launch to the leader
    END = "end"  # the agent asked the running attempt's ranks to leave it
    ENDED = "ended"  # the leader's `ended <code>`: every rank parked again after the attempt
    GONE = "gone"  # the leader's pipe closed: it exited (or is exiting)
    CLOSED = "closed"  # the agent closed it (EOF on its stdin, then KILL)


@dataclass(frozen=True, slots=True)
class Step:
    """What one event did: the state after it, and the attempt's end if it ended one."""

    state: ParkedState
    attempt_ended: bool = False  # a running attempt ended with this event
    parked_again: bool = False  # ... with every rank parked again (the group serves the next one)
    ignored: bool = False  # the event means nothing in this state (an `end` while parked, say)


_RUNS = (ParkedState.RUNNING, ParkedState.LEAVING)


def transition(state: ParkedState, event: ParkedEvent) -> Step:
    """The state after `event` in `state`; an event that means nothing there leaves it unchanged."""
    if event in (ParkedEvent.GONE, ParkedEvent.CLOSED):
        if state is ParkedState.FAILED and event is ParkedEvent.GONE:
            return Step(state, ignored=True)  # the watcher saw it exit already
        return Step(ParkedState.DEAD, attempt_ended=state in _RUNS)
    if state is ParkedState.STARTING:
        if event is ParkedEvent.READY:
            return Step(ParkedState.PARKED)
        if event is ParkedEvent.FAILED:
            return Step(ParkedState.FAILED)
    elif state is ParkedState.PARKED:
        if event is ParkedEvent.HAND_OFF:
            return Step(ParkedState.RUNNING)
    elif state in _RUNS:
        if event is ParkedEvent.END:
            return Step(ParkedState.LEAVING)
        if event is ParkedEvent.ENDED:
            return Step(ParkedState.PARKED, attempt_ended=True, parked_again=True)
    return Step(state, ignored=True)
