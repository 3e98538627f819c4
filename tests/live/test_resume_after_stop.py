"""Issue 26: a run that a stop ended can be launched again. `controller run --resume` (implied by
--exit-when-done, whose exit 75 asks for a requeue) clears a run-ending stop requested before the
process started; one requested after its start, or a daemon's restart without --resume, keeps it.

Real etcd, the real `LiveController` and `Supervisor`, an agent double; the test writes the node's
exit record into etcd as its agent would after the ranks saved and exited on the stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from controller.backends.base import RunOutcome
from controller.live.loop import LiveController, ShellConfig
from controller.supervisor.machine import Supervisor
from controller.supervisor.policy import RunPlan
from runwarden.store import Store
from runwarden.v1 import common_pb2, store_pb2
from runwarden.v1 import events_pb2 as E
from tests.live.shell import RUN, LogWatch, agent_double, is_launch, policy

pytestmark = pytest.mark.timeout(120)


@contextmanager
def shell(
    store: Store, run_dir: Path, resume_stopped_before: float | None
) -> Iterator[tuple[LiveController, LogWatch]]:
    cfg = ShellConfig(
        run=RUN,
        command=("train.py",),
        run_dir=run_dir,
        identity="test-controller",
        election_ttl_s=2.0,
        tick_s=0.1,
        resume_stopped_before=resume_stopped_before,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    controller = LiveController(cfg, store, lambda: Supervisor(policy(), RunPlan(run=RUN, nodes=1)))
    watch = LogWatch()
    controller.listeners.append(watch)
    thread = threading.Thread(target=controller.run, name="test-shell", daemon=True)
    thread.start()
    try:
        yield controller, watch
    finally:
        controller.stop()
        thread.join(timeout=15)
        controller.close()
        assert not thread.is_alive(), "the shell did not stop"


def request_stop(store: Store, at: float) -> None:
    """What `controllerctl stop RUN` (no --relaunch) writes through the API."""
    req = store_pb2.StopRequest(
        run=RUN, reason="time limit", requested_at=at, requested_by="ops", relaunch=False
    )
    store.put(store.keys.stop(RUN), req.SerializeToString())


def stop_the_run(store: Store, run_dir: Path, planned_stop: str = "stop requested: time limit") -> float:
    """Attempt 1 launched, stopped on request, its ranks saved and exited 0 (their agent's record says
    why unless `planned_stop` is ""): the run is over (exit 75). Returns when the stop was requested."""
    with agent_double(store), shell(store, run_dir, None) as (controller, log):
        log.wait(is_launch(1), 20)
        at = time.time()
        request_stop(store, at)
        log.wait(lambda e: e.kind == E.EVENT_KIND_STOP_REQUEST, 20)  # the ranks save and exit
        done = common_pb2.ExitStatus(exit_code=0, ended_at=time.time(), planned_stop=planned_stop)
        prog = store_pb2.NodeProgress(node="n1", run=RUN, attempt=1, exit=done)
        store.put(store.keys.progress(RUN, "n1"), prog.SerializeToString())
        assert controller.done.wait(20), "the run did not end"
        assert controller.outcome is RunOutcome.STOPPED
    return at


def wait_gone(store: Store, key: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while store.get(key) is not None:
        assert time.monotonic() < deadline, f"{key} is still there"
        time.sleep(0.05)


# "": ranks that did not say why they exited 0 (an exit record like a finished run's): the resumed
# controller must still relaunch, not call the run completed.
@pytest.mark.parametrize("planned_stop", ["stop requested: time limit", ""], ids=["planned", "bare-exit-0"])
def test_resume_clears_a_stop_older_than_the_start_and_launches_again(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, planned_stop: str
) -> None:
    stop_the_run(store, tmp_path / "run", planned_stop)
    caplog.set_level(logging.INFO, logger="controller.live.loop")
    with agent_double(store), shell(store, tmp_path / "run", time.time()) as (controller, log):
        log.wait(is_launch(2), 30)
        wait_gone(store, store.keys.stop(RUN), 10)  # the relaunch retired it
        assert controller.outcome is None and not controller.done.is_set(), "a resumed run is not over"
        assert log.find(lambda e: e.kind == E.EVENT_KIND_DETECTION) is None, "no failure was made of it"
    assert any("cleared the stop that ended it (requested by ops" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("resume", [True, False], ids=["stop-after-start", "daemon-restart"])
def test_a_stop_is_kept_when_it_is_newer_than_the_start_or_without_resume(
    store: Store, tmp_path: Path, resume: bool
) -> None:
    at = stop_the_run(store, tmp_path / "run")
    # resume: the stop came while this controller was starting (requested after its start)
    with (
        agent_double(store) as agent,
        shell(store, tmp_path / "run", at - 1.0 if resume else None) as (
            controller,
            log,
        ),
    ):
        assert controller.done.wait(20), "the stopped run was not recognised as over"
        assert controller.outcome is RunOutcome.STOPPED
        assert store.get(store.keys.stop(RUN)) is not None
        assert log.find(is_launch(2)) is None and "LaunchWorkers" not in agent.calls
