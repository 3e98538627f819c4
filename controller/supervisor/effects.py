"""The effect vocabulary of the supervisor core: what a rule may do besides changing the run's
data. Log an event, emit an action, persist a node's record, page, release a node. Everything a
handler does to the world goes through these and lands, in order, in the `Batch` that
`Supervisor.handle` returns. `Run` inherits them; the rules call them on the run."""

from __future__ import annotations

from typing import Any

from controller.supervisor.actions import Action, PersistNode, Release
from controller.supervisor.actions import Page as PageAction
from controller.supervisor.policy import RunPlan
from controller.supervisor.pool import Pool
from runwarden.v1 import events_pb2
from runwarden.v1 import events_pb2 as E


class Effects:
    """The entries and actions of the event being handled, and the verbs that add to them."""

    # what the effects read of the run (set by Run)
    plan: RunPlan
    pool: Pool
    now: float
    attempt: int
    job_step: int

    def __init__(self) -> None:
        self._entries: list[events_pb2.Event] = []
        self._actions: list[Action] = []

    def log(
        self,
        kind: events_pb2.EventKind.ValueType,
        message: str,
        step: int | None = None,
        attempt: int | None = None,
        **detail: Any,
    ) -> None:
        self._entries.append(
            E.Event(
                ts=self.now,
                run=self.plan.run,
                attempt=self.attempt if attempt is None else attempt,
                step=self.job_step if step is None else step,
                kind=kind,
                message=message,
                **detail,
            )
        )

    def emit(self, action: Action) -> None:
        self._actions.append(action)

    def persist(self, node: str) -> None:
        self.emit(PersistNode(record=self.pool.get(node).view()))

    def emit_release(self, node: str, reason: str) -> None:
        self.emit(Release(node=node, reason=reason))

    def page(self, reason: str) -> None:
        self.log(E.EVENT_KIND_PAGE, reason, page=E.PageDetail(reason=reason, severity="critical"))
        self.emit(PageAction(reason=reason))
