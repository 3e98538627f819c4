"""Every change of the run's state: the only module that assigns `Run.state`.

Each `become_*` sets the state together with what the state promises (its deadline, its timer, the
attempt's bookkeeping), after `Run.check_move` (the machine's table) has accepted the move. Rules
call these; nothing else writes the state (tests/supervisor/test_structure.py checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.supervisor.states import RunState
from runwarden.v1 import events_pb2 as E

if TYPE_CHECKING:
    from controller.supervisor.run import Run


def _enter(sv: Run, state: RunState) -> None:
    if state is sv.state:
        return
    sv.check_move(sv.state, state)
    sv.state = state


def become(sv: Run, state: RunState) -> None:
    _enter(sv, state)


def finish(sv: Run, state: RunState, outcome: str, reason: str) -> None:
    """The run ends in `state` (terminal): its nodes are given back, the end is logged."""
    sv.release_slots()
    _enter(sv, state)
    sv.failure = None
    sv.log(E.EVENT_KIND_RUN_END, reason, run_detail=E.RunDetail(nodes=sv.plan.nodes, outcome=outcome))
