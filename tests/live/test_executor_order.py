"""The live executor runs a batch's actions in the core's order, but the supervisor's memory first."""

from __future__ import annotations

from controller.live.executor import memory_first
from controller.supervisor.actions import Page, PersistMemory, SetTimer
from runwarden.v1 import store_pb2


def test_a_batch_writes_the_supervisors_memory_before_it_acts() -> None:
    """A leader killed in the middle of a batch has written what its logged decisions counted."""
    memory = PersistMemory(record=store_pb2.SupervisorMemory(run="r", decided_attempt=2))
    page, timer = Page(reason="crash loop"), SetTimer(key="relaunch", at=1.0)
    assert memory_first([page, timer, memory]) == [memory, page, timer]
    assert memory_first([timer, page]) == [timer, page]
